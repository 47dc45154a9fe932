"""Debian's Chromium as the watch page's tests and benchmark launch it (never a downloaded one)."""

CHROMIUM = "/usr/bin/chromium"  # apt-get install chromium
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
