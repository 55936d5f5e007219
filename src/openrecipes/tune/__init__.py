"""The tuner (`openrecipes tune`): a hand-written starting recipe to a faster, verified recipe card.

space.py (what may change, from the numerics rules) -> predict.py (planner ranking, pruning, refit) -> search.py
(trials through runner.py, recorded by journal.py, shown by progress.py) -> verification.py -> publish.py.
"""
