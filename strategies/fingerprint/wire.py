"""The fingerprint report's wire keys (ATLAS's and MIRA's), read by both ``server.py`` and ``client.py``."""

FINGERPRINT = "fingerprint"  # report array: the client's sanitised task fingerprint (sketch-dim numbers)
LAYER_NAMES = "layer_names"  # report metric: the adapted layers, in the order of LAYER_IMPORTANCE
LAYER_IMPORTANCE = "layer_importance"  # report metric: each adapted layer's gradient norm (ATLAS's rank allocation)
FINGERPRINT_BATCHES = "fingerprint_batches"  # report metric: how many batches the gradient was taken over
