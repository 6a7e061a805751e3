"""Deprecated (0.6): the built-in task and tiny model moved to :mod:`respo_trl.builtin`.

``respo_trl.demo.tasks`` is now ``respo_trl.builtin.task`` and ``respo_trl.demo.tiny`` is ``respo_trl.builtin.tiny_model``;
these modules re-export them with a ``DeprecationWarning`` and will be removed in 0.7.
"""
