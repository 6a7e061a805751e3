"""Hub pushes that fail clearly and never cost the local checkpoint.

Why: ``trainer.push_to_hub()`` is transformers' code path and we keep it. But when the Hub cannot be used (offline
mode, no network, endpoint down, bad or read-only token) it surfaces a bare transport error such as
``ConnectError: [Errno 111] Connection refused``, and when the repository could not be created it fails *before* the
final model is written to ``output_dir``, so a script that ends with ``push_to_hub()`` loses its last weights.
:func:`hub_failure` turns those errors into a :class:`HubPushError` that says what went wrong and how to retry, after
making sure the checkpoint is on disk.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from huggingface_hub import constants
from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError, OfflineModeIsEnabled

try:  # the HTTP client's base error (httpx2 in huggingface_hub 2.x, re-exported by huggingface_hub.errors)
    from huggingface_hub.errors import HTTPError as _ClientHTTPError
except ImportError:  # pragma: no cover - other huggingface_hub layouts
    _ClientHTTPError = OSError


class HubPushError(OSError):
    """The Hub could not be reached or refused the push; the message says why, where the local copy is, how to retry."""

    def __init__(self, message: str, why: str):
        super().__init__(message)
        self.why = why


# Errors that mean "the Hub could not be used"; a local OSError (disk full, permissions) is not among them.
HUB_ERRORS = (
    HubPushError,
    HfHubHTTPError,
    _ClientHTTPError,
    OfflineModeIsEnabled,
    LocalTokenNotFoundError,
    ConnectionError,
    TimeoutError,
)


def reason(error: BaseException) -> str:
    """One line on why a Hub call failed, with what to do about it."""
    if isinstance(error, OfflineModeIsEnabled):
        return "offline mode is on (HF_HUB_OFFLINE=1): unset it to push"
    if isinstance(error, LocalTokenNotFoundError):
        return "no Hub token found: run `hf auth login` or set HF_TOKEN (a token with write access)"
    if isinstance(error, HfHubHTTPError):
        status = error.response.status_code if error.response is not None else None
        if status in (401, 403):
            return (
                f"the Hub rejected the token (HTTP {status}): run `hf auth login`, set HF_TOKEN, or pass hub_token= "
                "with a token that has write access to this repository"
            )
        return f"the Hub answered HTTP {status}: {str(error).splitlines()[0]}"
    return f"could not reach the Hub at {constants.ENDPOINT} ({type(error).__name__}: {error}); check the network or HF_ENDPOINT"


def _saved(output_dir: str) -> bool:
    return any(os.path.isfile(os.path.join(output_dir, name)) for name in ("config.json", "adapter_config.json"))


def push_to_hub(trainer, **kwargs):
    """``trainer.push_to_hub(**kwargs)`` (transformers' push, TRL's arguments) with ReSPO's card, and a Hub that cannot
    be used reported as a :class:`HubPushError` that says why, the model saved locally first. The recipe pushes
    through this; so can any script that trained a ``ReSPOTrainer``."""
    if trainer.card_writer is None:
        from .card import write_trainer_card

        trainer.card_writer = write_trainer_card
    with hub_failure(trainer, "push to the Hub repository", save_if_unsaved=True):
        return trainer.push_to_hub(**kwargs)


@contextmanager
def creating_repository(args):
    """Around building a trainer with ``push_to_hub=True`` (transformers creates the repository then): a Hub that
    cannot be used is a :class:`HubPushError` naming the repository, before any compute is spent."""
    try:
        yield
    except HUB_ERRORS as error:
        why = error.why if isinstance(error, HubPushError) else reason(error)
        repo = args.hub_model_id or os.path.basename(os.path.abspath(args.output_dir))
        raise HubPushError(f"Could not create the Hub repository {repo!r}: {why}. Nothing was uploaded.", why) from error


@contextmanager
def hub_failure(trainer, action: str, save_if_unsaved: bool = False):
    """Re-raise Hub and network errors of the block as :class:`HubPushError`.

    With ``save_if_unsaved`` (``push_to_hub``), when the push failed before transformers wrote the model (that happens
    when the repository cannot be created: ``trainer.hub_model_id`` is still unset), the model and its card are saved
    to ``output_dir`` first, on a single process. Under multi-process training only the main process reaches the Hub,
    so the message asks for ``trainer.save_model()`` instead.
    """
    repo_before = trainer.hub_model_id
    try:
        yield
    except HUB_ERRORS as error:
        why = error.why if isinstance(error, HubPushError) else reason(error)
        cause = (error.__cause__ or error) if isinstance(error, HubPushError) else error
        output_dir = os.path.abspath(trainer.args.output_dir)
        repo = trainer.args.hub_model_id or os.path.basename(output_dir)
        note = ""
        if save_if_unsaved and repo_before is None and trainer.hub_model_id is None:
            if trainer.accelerator.num_processes == 1:
                trainer.save_model(_internal_call=True)
                trainer.create_model_card(model_name=repo.split("/")[-1])
            else:
                note = " The final model was NOT saved: call trainer.save_model() on every process."
        state = f"The local copy is intact in {output_dir}." if _saved(output_dir) else "Nothing was uploaded."
        raise HubPushError(
            f"Could not {action} {repo!r}: {why}. {state}{note} Retry later with "
            f"`hf upload {repo} {output_dir} --exclude 'checkpoint-*'` or trainer.push_to_hub().",
            why,
        ) from cause
