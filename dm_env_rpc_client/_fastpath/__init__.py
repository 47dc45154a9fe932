"""Steps as bytes: action requests written into templates, responses read from their wire bytes and decoded by their learned layout."""
