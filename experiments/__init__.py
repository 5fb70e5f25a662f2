"""Experiments that reproduce the papers' claims on the synthetic world: curves, tables and sample sheets.

Each runs from the repository root as ``python -m experiments.<name>`` (``--help`` lists its options); README.md
beside this file says which claim each one tests, and docs/results.md quotes their figures. They import the package
and ``bench/``'s shared measures; nothing in the package, ``bench/`` or the tests imports them.
"""
