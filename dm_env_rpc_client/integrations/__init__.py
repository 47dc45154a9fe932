"""Bridges to optional libraries, each behind a setup.py extra; the core never imports them."""
