"""Every name respo_trl no longer accepts, with what replaces it and the release that stopped accepting it, in one
place.

Why keep old names at all: a config, preset or command line written for an earlier release must not fail with
"unexpected keyword argument" or "unknown option" and leave the user to guess what changed. Each name here is refused
in one line that says what to set instead (:func:`refuse_renamed`), wherever it can arrive: ``ReSPOConfig(...)`` and
``ReSPOConfig.from_grpo_config`` (:data:`RENAMED_OPTIONS`), the recipe's command line and config files (the same
table), ``--preset`` (:data:`RENAMED_PRESETS`), verl's ``policy_loss`` config (:data:`RENAMED_VERL_KEYS`) and the
kernel's Python names (:data:`REMOVED_NAMES`).

Nothing is deprecated-but-working in this release: a name that is deprecated again gets its warning and the release
that removes it here, next to the names already removed. What each release changed is CHANGELOG.md's.
"""

from __future__ import annotations

from typing import NamedTuple


class Renamed(NamedTuple):
    new: str  # what to set instead
    release: str  # the first respo_trl release that refuses the old name
    why: str = ""  # what the new name means, when the old one does not say


# ReSPOConfig's keyword arguments, the recipe's flags and the keys of its config files (the same names).
RENAMED_OPTIONS = {
    "updates_per_rollout": Renamed(
        "respo_updates_per_rollout",
        "0.4",
        "ReSPOConfig's field, the one name of the paper's staleness N from preset to trainer",
    ),
    "respo_reuse": Renamed("num_iterations", "0.7", "TRL's name for the same setting: epochs over each rollout batch"),
}
# --preset names.
EPOCHS_PRESETS_WHY = (
    "R = 4 epochs on the post-trained model; the ReSPO paper's runs are paper-qwen3-1.7b-base and "
    "paper-qwen3-30b-a3b-base"
)
RENAMED_PRESETS = {
    **{f"qwen3-{size}": Renamed(f"qwen3-{size}-epochs4", "0.2", EPOCHS_PRESETS_WHY)
       for size in ("0.6b", "1.7b", "4b", "8b", "14b", "30b-a3b")},
    "tiny_cpu": Renamed("tiny-cpu", "0.3", "every preset name uses dashes"),
}  # fmt: skip
# Python names of respo_trl.kernels (and the package's top level).
REMOVED_NAMES = {
    "respo_coefficients": Renamed(
        "respo_weights", "0.8", "every engine's one coefficient function; its .coefficients is what respo_coefficients returned"
    ),
}
# Keys of verl's actor_rollout_ref.actor.policy_loss (respo_trl.integrations.verl): ReSPOConfig's names in TRL and verl.
RENAMED_VERL_KEYS = {
    "respo_lam_pos": Renamed("respo_lambda_pos", "0.7", "ReSPOConfig's name, one spelling in TRL and verl"),
    "respo_lam_neg": Renamed("respo_lambda_neg", "0.7", "ReSPOConfig's name, one spelling in TRL and verl"),
}


def renamed_message(old: str, renamed: Renamed, what: str = "{}", value=None) -> str:
    """One line: ``old`` was renamed, since which release it is refused, and what to set instead. ``what`` formats a
    name as the user writes it (``"--{}"`` for a flag, ``"{!r}"`` for a preset, a config prefix for verl); with
    ``value``, the line says ``old=value`` and ``new=value``."""
    setting = "" if value is None else f"={value!r}"
    why = f"{renamed.why}; " if renamed.why else ""
    line = (f"{what.format(old)}{setting} was renamed {what.format(renamed.new)} ({why}the old name is refused since "
            f"respo_trl {renamed.release})")  # fmt: skip
    return line + (f": set {what.format(renamed.new)}{setting} instead" if setting else "")


def refuse_renamed(given, table: dict[str, Renamed], what: str = "{}", error: type[ValueError] = ValueError) -> None:
    """Raise ``error`` with :func:`renamed_message` for the first name of ``given`` that ``table`` lists; ``given`` is
    names, or a mapping of names to the values given (keyword arguments, a config file)."""
    for name in given:
        if name in table:
            value = given[name] if isinstance(given, dict) else None
            raise error(renamed_message(name, table[name], what, value))
