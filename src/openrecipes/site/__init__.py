"""The static recipe site generated from the card catalog."""
