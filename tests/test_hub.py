"""Pushing through transformers' own ``push_to_hub`` with the Hub unusable: offline mode, an endpoint that refuses
connections, a server that rejects the token. Each must fail fast with a clear ``HubPushError`` and leave a complete,
loadable checkpoint in output_dir. The "Hub" here is at most a stub HTTP server on 127.0.0.1; nothing leaves the
machine, and an alarm fails a test that would hang."""

import hashlib
import json
import signal
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest


class Hung(Exception):
    pass


@pytest.fixture(autouse=True)
def no_hang():
    def fail(signum, frame):
        raise Hung("a Hub call hung")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def hub_endpoint(monkeypatch):
    """Point huggingface_hub (and transformers' shared HfApi) at ``url``, online mode."""
    import transformers.utils.hub
    from huggingface_hub import constants

    def use(url):
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "ENDPOINT", url)
        monkeypatch.setattr(transformers.utils.hub, "_hf_api", None)

    yield use


def closed_port_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens: connections are refused at once


@pytest.fixture
def stub_hub():
    """A local HTTP server that plays a Hub: ``create_status`` for repo creation, 403 for every upload call."""
    calls = []

    class Handler(BaseHTTPRequestHandler):
        create_status = 401

        def reply(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            calls.append(self.path)
            if self.path == "/api/repos/create":
                if Handler.create_status == 200:
                    self.reply(
                        200,
                        {"url": f"http://127.0.0.1:{self.server.server_port}/me/tiny-respo", "name": "me/tiny-respo"},
                    )
                else:
                    self.reply(401, {"error": "Invalid credentials in Authorization header"})
            else:
                self.reply(403, {"error": 'You don\'t have the rights to create a model under the namespace "me"'})

        do_GET = do_PUT = do_POST

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", Handler, calls
    server.shutdown()
    server.server_close()


def digest(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def assert_loadable(output_dir: Path):
    from transformers import AutoModelForCausalLM

    assert (output_dir / "model.safetensors").is_file() and (output_dir / "README.md").is_file()
    AutoModelForCausalLM.from_pretrained(output_dir)


def test_push_offline_fails_clearly_and_saves_the_model(make_trainer, tmp_path):
    from respo_trl.hub.push import HubPushError, push_to_hub

    trainer = make_trainer(max_steps=1, hub_model_id="me/tiny-respo", hub_token="hf_invalid")
    trainer.train()
    output_dir = tmp_path / "out"
    assert not (output_dir / "model.safetensors").exists()  # nothing saved yet: only the push would save it
    with pytest.raises(HubPushError) as error:
        push_to_hub(trainer)
    message = str(error.value)
    assert "offline mode" in message and "HF_HUB_OFFLINE" in message and "'me/tiny-respo'" in message
    assert f"local copy is intact in {output_dir}" in message and "hf upload me/tiny-respo" in message
    assert_loadable(output_dir)  # transformers' push fails before saving; the failure path saved it


def test_push_to_unreachable_endpoint_leaves_checkpoint_intact(make_trainer, tmp_path, hub_endpoint):
    from respo_trl.hub.push import HubPushError, push_to_hub

    trainer = make_trainer(max_steps=1, hub_model_id="me/tiny-respo", hub_token="hf_invalid")
    trainer.train()
    trainer.save_model()
    output_dir = tmp_path / "out"
    before = digest(output_dir)
    url = closed_port_url()
    hub_endpoint(url)
    with pytest.raises(HubPushError) as error:
        push_to_hub(trainer)
    assert f"could not reach the Hub at {url}" in str(error.value) and "local copy is intact" in str(error.value)
    after = digest(output_dir)
    assert all(after[name] == sha for name, sha in before.items()), "a saved file changed"  # (the card may be added)
    assert_loadable(output_dir)


def test_bad_token_is_named_and_upload_refusal_keeps_local_files(make_trainer, tmp_path, hub_endpoint, stub_hub):
    from respo_trl.hub.push import HubPushError, push_to_hub

    url, handler, calls = stub_hub
    hub_endpoint(url)
    trainer = make_trainer(max_steps=1, hub_model_id="me/tiny-respo", hub_token="hf_invalid")
    trainer.train()
    with pytest.raises(HubPushError) as error:
        push_to_hub(trainer)
    assert "rejected the token (HTTP 401)" in str(error.value) and "hf auth login" in str(error.value)
    # (huggingface_hub may also POST its own telemetry, e.g. /api/agent-harnesses, once per process: not asserted on)
    assert "/api/repos/create" in calls and not any("preupload" in c or "commit" in c for c in calls)
    assert_loadable(tmp_path / "out")

    # Repository creation accepted, upload refused (a read-only token): the model was saved first by transformers.
    handler.create_status = 200
    calls.clear()
    with pytest.raises(HubPushError) as error:
        push_to_hub(trainer)
    assert "rejected the token (HTTP 403)" in str(error.value)
    assert "/api/repos/create" in calls  # created, then the upload was refused
    assert calls[calls.index("/api/repos/create") + 1 :], calls
    assert_loadable(tmp_path / "out")


def test_push_to_hub_at_construction_fails_clearly(make_trainer, hub_endpoint):
    from respo_trl.hub.push import HubPushError

    url = closed_port_url()
    hub_endpoint(url)
    from types import SimpleNamespace

    from respo_trl.hub.push import creating_repository

    args = SimpleNamespace(output_dir="out", hub_model_id="me/tiny-respo")  # what the message reads of the config
    with pytest.raises(HubPushError, match="Could not create the Hub repository 'me/tiny-respo'.*could not reach"):
        with creating_repository(args):  # the recipe builds its trainer in here
            make_trainer(max_steps=1, push_to_hub=True, hub_model_id="me/tiny-respo", hub_token="hf_invalid")


def test_local_errors_are_not_reported_as_hub_errors(make_trainer, monkeypatch):
    """A disk problem while saving must surface as itself, not as a network failure."""
    from respo_trl.hub.push import HubPushError, push_to_hub

    trainer = make_trainer(max_steps=1, hub_model_id="me/tiny-respo")
    trainer.hub_model_id = "me/tiny-respo"  # repository already created: transformers saves before uploading

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trainer, "save_model", disk_full)
    with pytest.raises(OSError, match="No space left") as error:
        push_to_hub(trainer)
    assert not isinstance(error.value, HubPushError)


def test_push_uploads_exactly_one_model(make_trainer, tmp_path, monkeypatch):
    """The recipe keeps its best in-training weights beside the final ones (keep_best_heldout): a push of output_dir
    must upload the final model only (0.2 kept them in best-heldout/, which the upload would have included)."""
    import transformers.trainer
    from huggingface_hub.utils import filter_repo_objects

    from respo_trl.hub.push import push_to_hub
    from respo_trl.recipe import BEST_HELDOUT_DIR

    trainer = make_trainer(max_steps=1, push_to_hub=False)
    trainer.train()
    out = Path(trainer.args.output_dir)
    trainer.save_model(str(out / BEST_HELDOUT_DIR))  # as the recipe saves the best checkpoint
    calls = []

    created = []

    class FakeApi:
        def upload_folder(self, **kwargs):
            calls.append(kwargs)

        def create_repo(self, name, **kwargs):
            created.append(kwargs)
            return type("Url", (), {"repo_id": name})()

    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: FakeApi())
    trainer.hub_model_id = None  # as with push_to_hub=False: the push creates the repository first
    push_to_hub(trainer, commit_message="ReSPO run 7", blocking=False, revision="v1", token="hf_run7", private=True,
                        tags=["run-7-tag"])  # fmt: skip
    (call,) = calls
    assert call["commit_message"] == "ReSPO run 7" and call["run_as_future"] and call["revision"] == "v1"
    # the token and privacy reach the Hub calls; extra keyword arguments reach the card
    assert call["token"] == "hf_run7" and created[-1]["token"] == "hf_run7" and created[-1]["private"] is True
    assert "run-7-tag" in (out / "README.md").read_text()
    files = [str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()]
    uploaded = list(filter_repo_objects(files, ignore_patterns=call["ignore_patterns"]))
    assert sum(name.endswith("model.safetensors") for name in uploaded) == 1 and "model.safetensors" in uploaded
    assert not [name for name in uploaded if name.startswith(BEST_HELDOUT_DIR)]
    assert any(name.startswith(BEST_HELDOUT_DIR) for name in files)  # it is there, just not pushed


def test_repository_creation_passes_token_and_privacy_through(make_trainer, monkeypatch):
    import transformers.trainer

    created = []

    class FakeApi:
        def create_repo(self, name, **kwargs):
            created.append(kwargs)
            return type("Url", (), {"repo_id": name})()

    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: FakeApi())
    trainer = make_trainer(max_steps=1, hub_model_id="me/x")
    trainer.init_hf_repo(token="tok", private=True)
    assert created[-1]["token"] == "tok" and created[-1]["private"] is True
