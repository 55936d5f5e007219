"""Verification: checks that a run, a recipe or a component behaves as its reference.

``openrecipes verify CHECK ...``; the checks are listed in :mod:`openrecipes.verify.cli`.
"""
