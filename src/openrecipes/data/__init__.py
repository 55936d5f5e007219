"""SFT data: chat templates, loss masks, fixed-length packed rows, manifests, THD batches."""
