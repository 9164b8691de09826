"""Rank-adaptation policy: config, rank penalty, early/late controller, param groups, accounting, pruning.

Modules (import them directly; this package keeps its import light so that the config can be
loaded without the layers): ``config``, ``walk``, ``penalty``, ``controller``, ``groups``,
``accounting``, ``pruning``.
"""
