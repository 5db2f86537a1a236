"""Where a model or tokenizer named by the user lives on disk: a local directory as given, else a Hugging Face Hub id
(``org/name``) found in the Hugging Face cache, else downloaded into it when online (vLLM's order).

Resolved once, in the coordinator's process (EngineConfig), so the workers are handed a plain local directory.
Only what nanoserve reads is downloaded: config, generation config, tokenizer files and safetensors weights (with
an index, only the files it names): never pickles (*.bin, *.pt), never a checkpoint's code. huggingface_hub reads
its own environment (HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE, HF_TOKEN, HF_ENDPOINT)."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

log = logging.getLogger("nanoserve.model_source")

MODEL, TOKENIZER = "model", "tokenizer"
INDEX = "model.safetensors.index.json"
# everything but the weights: what the engine reads besides them (the tokenizer's files in every layout it comes in)
META_PATTERNS = [
    "config.json",
    "generation_config.json",
    INDEX,
    "tokenizer*",  # tokenizer.json, tokenizer_config.json, tokenizer.model (sentencepiece, not a pickle)
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ModelSourceError(ValueError):
    """A model or tokenizer that cannot be found, or cannot be fetched; the message says where it was looked for,
    ``name`` which engine argument named it (resolve_sources)."""

    def __init__(self, message: str, name: str = MODEL) -> None:
        super().__init__(message)
        self.name = name


def resolve_sources(
    model: str, tokenizer: str, revision: str, tokenizer_revision: str, download_dir: str, trust_remote_code: bool
) -> tuple[str, str]:
    """``model`` and ``tokenizer`` (each when given) as local directories; a name that cannot be resolved is
    ModelSourceError, its ``name`` the engine argument (EngineConfig refuses it by that name)."""
    if trust_remote_code:
        log.info("trust_remote_code is accepted, but nanoserve never runs a checkpoint's own code")
    out = []
    for what, name, rev in ((MODEL, model, revision), (TOKENIZER, tokenizer, tokenizer_revision)):
        try:
            out.append(resolve(name, rev, download_dir, what) if name else name)
        except ModelSourceError as e:
            raise ModelSourceError(f"{what}: {e}", what) from None
    return out[0], out[1]


def resolve(name: str, revision: str = "", cache_dir: str = "", what: str = MODEL) -> str:
    """The local directory of ``name`` (``what``: "model" or "tokenizer"): the directory itself, or the snapshot of
    Hub id ``name`` at ``revision`` ('' = main) in the Hugging Face cache (``cache_dir`` or huggingface_hub's
    default, which HF_HOME / HF_HUB_CACHE set), downloaded into it unless HF_HUB_OFFLINE is set."""
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise ModelSourceError(
            f"{name!r} is a file, not a directory: give the checkpoint's directory (config.json, *.safetensors, "
            "tokenizer files) or a Hugging Face Hub id (org/name)"
        )
    from huggingface_hub import constants
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except ValueError:
        raise ModelSourceError(f"no directory {name!r}, and it is not a Hugging Face Hub id (org/name)") from None
    cache = str(Path(cache_dir or constants.HF_HUB_CACHE).expanduser())
    snapshot, missing = _cached(name, revision, cache, what)
    if snapshot and not missing:
        return snapshot
    if constants.HF_HUB_OFFLINE:
        shown = _shown(name, revision)
        found = (
            f"the snapshot of {shown} in the Hugging Face cache {cache} lacks {missing} ({snapshot})"
            if snapshot
            else f"{shown} is not in the Hugging Face cache {cache}"
        )
        raise ModelSourceError(
            f"no directory {name!r}, and {found}; HF_HUB_OFFLINE is set, so nothing is downloaded: download it "
            f"online once (`hf download {name}`), or set HF_HOME (or --download-dir) to the cache that holds it"
        )
    snapshot = _download(name, revision, cache, what)
    missing = _missing(snapshot, what)
    if missing:
        raise ModelSourceError(f"{_shown(name, revision)} from the Hugging Face Hub has no {missing} ({snapshot})")
    return snapshot


def _shown(name: str, revision: str) -> str:
    return f"{name!r} at revision {revision!r}" if revision else repr(name)


def _cached(name: str, revision: str, cache: str, what: str) -> tuple[str | None, str]:
    """The cached snapshot of ``name`` at ``revision`` (a branch, a tag or a commit) and what it lacks ('' =
    nothing), or (None, '') when there is none; no network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:  # only our patterns: huggingface_hub's listing of the repo also names files never fetched (*.bin ...)
        snapshot = snapshot_download(
            name, revision=revision or None, cache_dir=cache, local_files_only=True, allow_patterns=META_PATTERNS
        )
    except LocalEntryNotFoundError as e:
        # IncompleteSnapshotError (a LocalEntryNotFoundError): the listing names files of ours that are not there
        partial = getattr(e, "snapshot_path", None)
        return (partial, "files its listing names (an interrupted download?)") if partial else (None, "")
    return snapshot, _missing(snapshot, what)


def _missing(snapshot: str, what: str) -> str:
    """What a snapshot lacks to serve as ``what`` ('' = nothing): a model needs config.json and safetensors
    weights (every file its index names), a tokenizer its tokenizer files."""
    root = Path(snapshot)
    if what == TOKENIZER:
        return "" if any((root / f).is_file() for f in _TOKENIZER_FILES) else "tokenizer files"
    if not (root / "config.json").is_file():
        return "config.json"
    names = _indexed_weights(root)
    if names is None:
        return "" if any(root.glob("*.safetensors")) else "*.safetensors weights (nanoserve never loads pickles)"
    absent = sorted(n for n in names if not (root / n).is_file())
    return f"{absent[0]} (named in {INDEX})" if absent else ""


def _indexed_weights(root: Path) -> set[str] | None:
    index = root / INDEX
    if not index.is_file():
        return None
    return set(json.loads(index.read_text())["weight_map"].values())


def _download(name: str, revision: str, cache: str, what: str) -> str:
    """Fetch into the cache what nanoserve reads of ``name``: first everything but the weights, then (a model) the
    safetensors files, only those its index names when it has one (some repos also ship a consolidated copy)."""
    from huggingface_hub import snapshot_download

    log.info("downloading %s from the Hugging Face Hub into %s", _shown(name, revision), cache)
    try:
        with _quiet_http():
            snapshot = snapshot_download(name, revision=revision or None, cache_dir=cache, allow_patterns=META_PATTERNS)
            if what == MODEL:
                names = _indexed_weights(Path(snapshot))
                patterns, ignore = (sorted(names), None) if names is not None else (["*.safetensors"], ["*/*"])
                # the commit the first call resolved: both calls read one snapshot, even if the branch moves
                commit = Path(snapshot).name
                snapshot = snapshot_download(
                    name, revision=commit, cache_dir=cache, allow_patterns=patterns, ignore_patterns=ignore
                )
    except Exception as e:  # not found, gated, no network: one line naming the id, whatever the cause
        raise ModelSourceError(
            f"no directory {name!r}, and {_shown(name, revision)} could not be fetched from the Hugging Face Hub "
            f"into {cache}: {_why(e, revision)}"
        ) from e
    return snapshot


def _why(e: Exception, revision: str) -> str:
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(e, GatedRepoError):
        return "it is gated: accept its terms on the Hub and set HF_TOKEN"
    if isinstance(e, RepositoryNotFoundError):
        return "the Hub has no such repository (a private one needs HF_TOKEN)"
    if isinstance(e, RevisionNotFoundError):
        return f"the repository has no revision {revision!r}"
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


@contextlib.contextmanager
def _quiet_http():
    """No INFO line per HTTP request from the Hub client's HTTP library while we download."""
    loggers = [logging.getLogger(n) for n in ("httpx", "httpx2", "httpcore")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(lg.getEffectiveLevel(), logging.WARNING))
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def served_model_name(model: str) -> str:
    """The name the HTTP API serves a model under unless told otherwise: ``--model`` as the user typed it (a Hub id
    stays org/name, a path the path), or the embedded default model's short id."""
    if model:
        return model
    from model.tiny import DEFAULT_MODEL_ID

    return DEFAULT_MODEL_ID
