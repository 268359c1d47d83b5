"""Shared test set-up: keep every test's state out of the real /var/lib/azqemu unless asked."""
