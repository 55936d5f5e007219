"""Recipe cards: the schema, safe loading, and validation of `recipes/<model>/<gpu>/<name>.yaml`."""
