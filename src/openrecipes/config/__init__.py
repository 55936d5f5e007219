"""The lowest floor: the recipe tree, the parallel layout and the hostile-YAML loader.

Every other package (train, plan, verify, cards, site, tune) imports from here; nothing here imports them.
"""
