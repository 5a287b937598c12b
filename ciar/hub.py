"""Hugging Face Hub references in world files, resolved through `huggingface_hub`'s standard cache.

    hf://OWNER/REPO[@REVISION]/PATH     a file of a repository (a LlamaGen checkpoint, a VQGAN yaml)
    hf://OWNER/REPO[@REVISION]          a snapshot of a repository (a transformers folder: flan-t5-xl, Anole)
    hf://OWNER/REPO[@REVISION]/FOLDER   a folder field may also name a folder inside a repository
    hf://datasets/OWNER/REPO[@REVISION][/PATH]   the same in a dataset repository

REVISION is a commit hash (pinned: nothing moves under a world file), a branch or a tag; without one, `main`. The
grammar is huggingface_hub's own `hf://` URI for models and datasets (`refs/pr/N` revisions included).

    ref = parse_ref("hf://peizesun/llamagen_t2i@276f5c5a3d915b922899a03f1912605531574747/vq_ds16_t2i.pt")
    path = resolve(ref, "file")    # $HF_HUB_CACHE/models--peizesun--llamagen_t2i/snapshots/276f5c5.../vq_ds16_t2i.pt

Everything goes through `hf_hub_download` / `snapshot_download` into the standard cache, so the environment means
what it means to every Hugging Face library: `HF_HOME` / `HF_HUB_CACHE` (where), `HF_TOKEN` (gated or private
repositories), `HF_HUB_OFFLINE=1` (the cache only, never the network), `HF_ENDPOINT` (a mirror), and its progress
bars while downloading. They are read when a reference is resolved, not when this module is imported, so a process
(a Ray worker, a test) that sets them late is still obeyed. A transformers snapshot downloads only what a loader
reads (`TRANSFORMERS_PATTERNS`: configs, tokenizers, safetensors; the `.bin` weights only when a revision has no
safetensors), not the TensorFlow / Flax copies many repositories carry (flan-t5-xl: 11 of its 46 GB).

Every failure is one line (`HubError`) naming the repository, the revision and the file, and what to do: fetch ahead
(`python -m ciar.world_spec fetch WORLD`, or `hf download ...`), set `HF_TOKEN`, or fix the reference. No Ray here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

SCHEME = "hf://"
DEFAULT_REVISION = "main"
# what a transformers `from_pretrained` of a model + tokenizer folder reads (config.json, generation_config.json,
# the safetensors index and shards, tokenizer.json / tokenizer_config.json / special_tokens_map.json, spiece.model,
# vocab / merges .txt); never the TensorFlow (.h5), Flax (.msgpack) or duplicate PyTorch (.bin) weights
TRANSFORMERS_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken")
BIN_PATTERNS = ("pytorch_model*.bin",)  # only when a revision has no safetensors weights
KINDS = ("file", "folder", "transformers")

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SPECIAL_REVISION = re.compile(r"^refs/(?:pr/\d+|convert/[\w.-]+)")
_PREFIXES = {"models/": "model", "datasets/": "dataset"}


class HubError(ValueError):
    """A Hub reference that cannot be resolved: one line naming the repository, the file and what to do."""


@dataclass(frozen=True)
class HubRef:
    """A parsed `hf://` reference (`raw` is the text as written)."""

    repo_id: str
    revision: str | None = None  # None: the repository's default branch (main)
    path: str = ""  # "" : the whole snapshot
    repo_type: str = "model"
    raw: str = ""

    @property
    def rev(self) -> str:
        return self.revision or DEFAULT_REVISION

    @property
    def pinned(self) -> bool:
        """True when the revision is a commit hash (a branch or a tag can move)."""
        return bool(self.revision and _COMMIT.match(self.revision))

    def where(self) -> str:
        """`OWNER/REPO@REV` as a person reads it (a commit shortened to 12 digits; datasets say so)."""
        rev = self.rev[:12] if self.pinned else self.rev
        return f"{'dataset ' if self.repo_type == 'dataset' else ''}{self.repo_id}@{rev}"

    def __str__(self) -> str:
        return self.raw or (f"{SCHEME}{'datasets/' if self.repo_type == 'dataset' else ''}{self.repo_id}"
                            f"{'@' + self.revision if self.revision else ''}{'/' + self.path if self.path else ''}")


def is_ref(value) -> bool:
    """Is `value` an `hf://` reference (any other string is a local path)?"""
    return isinstance(value, str) and value.startswith(SCHEME)


def parse_ref(value: str) -> HubRef:
    """`hf://[datasets/]OWNER/REPO[@REVISION][/PATH]` -> HubRef; HubError says what is wrong with a malformed one."""
    if not is_ref(value):
        raise HubError(f"{value!r} is not a Hub reference (hf://OWNER/REPO[@REVISION][/PATH])")
    body, repo_type = value[len(SCHEME):], "model"
    for prefix, kind in _PREFIXES.items():
        if body.startswith(prefix):
            body, repo_type = body[len(prefix):], kind
    owner, _, rest = body.partition("/")
    head, _, tail = rest.partition("/")  # head: REPO or REPO@REVISION (a refs/pr/N revision goes on into tail)
    if "@" in head:
        name, _, after = head.partition("@")
        after += "/" + tail if tail else ""
        special = _SPECIAL_REVISION.match(after)
        if special:
            revision, path = special.group(0), after[special.end():].lstrip("/")
        else:
            revision, _, path = after.partition("/")
        if not revision:
            raise HubError(f"{value}: an empty revision after '@' (a commit hash, a branch or a tag)")
    else:
        name, revision, path = head, None, tail
    for part, what in ((owner, "owner"), (name, "repository name")):
        if not _NAME.match(part or ""):
            raise HubError(f"{value}: the {what} {part!r} is not valid (hf://OWNER/REPO[@REVISION][/PATH])")
    segments = path.split("/") if path else []
    if path.endswith("/"):
        segments = segments[:-1]
    if any(s in ("", ".", "..") for s in segments):
        raise HubError(f"{value}: the path {path!r} has an empty, '.' or '..' segment")
    return HubRef(f"{owner}/{name}", revision, "/".join(segments), repo_type, value)


# ---------------------------------------------------------------------------------------------- the environment
def _true(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def cache_dir() -> str:
    """The hub cache huggingface_hub uses, from the environment as it is now: $HF_HUB_CACHE, else
    $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    env = os.environ
    given = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not given:
        home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"),
                                                  "huggingface")
        given = os.path.join(home, "hub")
    return os.path.abspath(os.path.expandvars(os.path.expanduser(given)))


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as set now, or as huggingface_hub read it at import."""
    if _true(os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")):
        return True
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def _endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None  # None: huggingface_hub's own (https://huggingface.co)


# ---------------------------------------------------------------------------------------------- resolution
def resolve(ref: "HubRef | str", kind: str = "file", *, download: bool = True, fetch_hint: str | None = None) -> str:
    """The local path of `ref` in the Hugging Face cache, downloading what is missing unless `download` is False or
    HF_HUB_OFFLINE is set. `kind`: "file" (the reference names a file), "folder" (a snapshot, or a folder of it) or
    "transformers" (a snapshot a transformers loader reads: its configs, tokenizer and weights, checked complete).
    `fetch_hint`: how the user fetches it ahead (e.g. the world's `fetch` command); default: the `hf download`
    command for this reference. Raises HubError (one line)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    ref = parse_ref(ref) if isinstance(ref, str) else ref
    if kind == "file" and not ref.path:
        raise HubError(f"{ref} names a whole repository, but a file is needed here: add its path "
                       f"({SCHEME}{ref.repo_id}@REVISION/FILE)")
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        raise HubError(f"{ref}: resolving Hub references needs the huggingface_hub package (pip install "
                       f"huggingface_hub; transformers installs it)") from None
    local_only = offline() or not download
    hint = fetch_hint or _download_command(ref, kind)
    try:
        if kind == "file":
            return _download_file(ref, local_only)
        return _download_folder(ref, kind, local_only, hint)
    except HubError:
        raise
    except Exception as e:  # noqa: BLE001 - every huggingface_hub / OS error becomes one readable line
        raise HubError(_explain(ref, kind, e, local_only, hint)) from None


def _common(ref: HubRef, local_only: bool) -> dict:
    return dict(repo_id=ref.repo_id, revision=ref.rev, repo_type=ref.repo_type, cache_dir=cache_dir(),
                local_files_only=local_only, endpoint=_endpoint())


def _download_file(ref: HubRef, local_only: bool) -> str:
    from huggingface_hub import hf_hub_download

    return hf_hub_download(filename=ref.path, **_common(ref, local_only))


def _download_folder(ref: HubRef, kind: str, local_only: bool, hint: str) -> str:
    from huggingface_hub import snapshot_download

    def snapshot(names):  # only the files under the reference's folder, when it names one
        patterns = [f"{ref.path}/{p}" for p in names] if ref.path else list(names)
        return snapshot_download(allow_patterns=patterns, **_common(ref, local_only))

    root = snapshot(TRANSFORMERS_PATTERNS if kind == "transformers" else ("*",))
    folder = os.path.join(root, *ref.path.split("/")) if ref.path else root
    if kind == "transformers" and not _weights(folder):
        snapshot(BIN_PATTERNS)  # an older revision with PyTorch .bin weights only
    if not os.path.isdir(folder) and (ref.path or kind != "transformers"):  # nothing matched: no snapshot folder
        raise HubError(f"{ref}: {ref.where()} has no {'folder ' + repr(ref.path) if ref.path else 'files'}")
    if kind == "transformers":
        missing = transformers_missing(folder)
        if missing and local_only:  # a partial download left in the cache
            raise HubError(f"{ref}: the cached snapshot of {ref.where()} is incomplete ({missing}); fetch it again "
                           f"where the Hub is reachable: {hint}")
        if missing:
            raise HubError(f"{ref}: {ref.where()} is not a transformers model folder ({missing})")
    return folder


def _weights(folder: str) -> list[str]:
    import glob

    return sorted(glob.glob(os.path.join(folder, "*.safetensors"))) or \
        sorted(glob.glob(os.path.join(folder, "pytorch_model*.bin")))


def transformers_missing(folder: str) -> str:
    """What a transformers model folder lacks for `from_pretrained` ("" when complete): config.json, a weight file,
    and every shard its index names. A snapshot that an interrupted or partial download left behind is named here,
    not by a traceback from deep in the loader."""
    import json

    if not os.path.isfile(os.path.join(folder, "config.json")):
        return "no config.json"
    if not _weights(folder):
        return "no *.safetensors or pytorch_model*.bin weights"
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        path = os.path.join(folder, index)
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    shards = sorted(set(json.load(f).get("weight_map", {}).values()))
            except (OSError, ValueError) as e:
                return f"{index} unreadable: {e}"
            gone = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
            if gone and index.startswith("model.safetensors"):
                return f"{len(gone)} of {len(shards)} shards named by {index} missing, e.g. {gone[0]}"
    return ""


def _download_command(ref: HubRef, kind: str) -> str:
    """The `hf download` command (huggingface_hub's CLI) that puts `ref` into the cache."""
    parts = ["hf download", ref.repo_id]
    if kind == "file":
        parts.append(ref.path)
    if ref.revision:
        parts.append(f"--revision {ref.revision}")
    if ref.repo_type != "model":
        parts.append(f"--repo-type {ref.repo_type}")
    if kind != "file":
        names = TRANSFORMERS_PATTERNS if kind == "transformers" else ("*",)
        parts.append("--include " + " ".join(f"'{ref.path + '/' if ref.path else ''}{p}'" for p in names))
    return " ".join(parts)


def _explain(ref: HubRef, kind: str, e: Exception, local_only: bool, hint: str) -> str:
    """One line for a huggingface_hub / OS error: what failed (repository, revision, file), why, and what to do."""
    try:
        from huggingface_hub import errors
    except ImportError:  # huggingface_hub < 0.23 kept its errors in utils
        from huggingface_hub import utils as errors

    def cls(name):  # absent in older huggingface_hub versions: matches nothing
        return getattr(errors, name, ())

    what = f"{ref.path} of {ref.where()}" if ref.path else f"the snapshot of {ref.where()}"
    if kind != "file" and ref.path:
        what = f"folder {ref.path} of {ref.where()}"
    if isinstance(e, cls("GatedRepoError")):
        return (f"{ref}: {ref.repo_id} is gated: accept its conditions on the Hub with your account and set "
                f"HF_TOKEN (or `hf auth login`)")
    if isinstance(e, cls("RepositoryNotFoundError")):
        return (f"{ref}: repository {ref.repo_id} not found on the Hub (a typo, or private: set HF_TOKEN to a token "
                f"that can read it)")
    if isinstance(e, cls("RevisionNotFoundError")):
        return f"{ref}: {ref.repo_id} has no revision {ref.rev!r} (a commit hash, a branch or a tag)"
    if isinstance(e, cls("IncompleteSnapshotError")):  # a listing in the cache says files are missing
        missing = re.search(r"\d+ file\(s\) (?:are|is) missing(?: \([^)]*\))?", str(e))
        return (f"{ref}: the cached snapshot of {ref.where()} is incomplete"
                f"{' (' + missing.group(0) + ')' if missing else ''}; fetch it again where the Hub is reachable: "
                f"{hint}")
    if isinstance(e, (cls("LocalEntryNotFoundError"), cls("OfflineModeIsEnabled"))):
        where = f"is not in the Hugging Face cache {cache_dir()}"
        if local_only and offline():
            return (f"{ref}: {what} {where} and HF_HUB_OFFLINE=1 forbids downloading it; fetch it ahead where the "
                    f"Hub is reachable (HF_HUB_OFFLINE unset), into the same HF_HOME: {hint}")
        if local_only:
            return f"{ref}: {what} {where} (downloads not allowed here); fetch it ahead: {hint}"
        return (f"{ref}: {what} {where} and the Hub ({_endpoint() or 'https://huggingface.co'}) could not be "
                f"reached; fetch it where the Hub is reachable, into the same HF_HOME: {hint}")
    if isinstance(e, cls("EntryNotFoundError")):
        return f"{ref}: {ref.where()} has no file {ref.path!r}"
    if isinstance(e, cls("HfHubHTTPError")):
        status = getattr(getattr(e, "response", None), "status_code", None)
        return f"{ref}: the Hub answered {status or 'an error'} for {what}: {first_line(e)}"
    if isinstance(e, (cls("HFValidationError"), cls("HfUriError"))):
        return f"{ref}: not a valid reference: {first_line(e)}"
    if isinstance(e, OSError):
        return f"{ref}: could not fetch {what} into {cache_dir()}: {type(e).__name__}: {first_line(e)}"
    return f"{ref}: could not resolve {what}: {type(e).__name__}: {first_line(e)}"


def first_line(e: Exception) -> str:
    """An error's message in one line: its first (its type's name when it has none)."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ---------------------------------------------------------------------------------------------- what is cached
def disk_size(path: str) -> int:
    """Bytes of a resolved file, or of every file under a resolved folder (the cache's symlinks followed)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files if os.path.isfile(os.path.join(root, f)))
    return total


def commit_of(path: str) -> str | None:
    """The commit hash of a path inside the hub cache (`.../snapshots/<commit>/...`), None elsewhere."""
    parts = os.path.normpath(path).split(os.sep)
    for i, part in enumerate(parts[:-1]):
        if part == "snapshots" and _COMMIT.match(parts[i + 1]):
            return parts[i + 1]
    return None


def human_bytes(n: int) -> str:
    """1234567 -> '1.2 MB' (decimal units, as the Hub shows sizes)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
