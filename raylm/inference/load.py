"""A trained checkpoint, found and checked, as a plain single-process model with its tokenizer and
config (local or s3:// checkpoints and runs): what generation, evaluation and export start from."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import sys
import tempfile
import warnings
from typing import Callable, Iterator, Optional, TypeVar

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from raylm.config import CONFIG_FILE, Config, ConfigError, StorageConfig, saved_config
from raylm.data import storage
from raylm.model.sizes import count_params
from raylm.model.transformer import Transformer
from raylm.data.tokenizer import TOKENIZER_FILE, Tokenizer, tokenizer_from_json
from raylm.train.checkpoint import format as checkpoint
from raylm.train.checkpoint.resume import read_saved_config
from raylm.train.checkpoint.metadata import METADATA_FILE, read_metadata


T = TypeVar("T")

# A running run removes its older checkpoints as it saves newer ones (checkpoint.keep_last), and
# a reader of its newest can find that one gone: it lists the run's checkpoints again, this often.
RELISTS = 3


def resolve_checkpoint(uri: str, storage_cfg: Optional[StorageConfig] = None, announce: bool = True,
                       checksums: bool = False) -> str:
    """A checkpoint directory, or the newest complete one inside a run directory (local or s3://),
    by its manifest and files' sizes; with `checksums`, also by every file's sha256, read where it
    lies: for a driver that picks the checkpoint its workers load (`sound_checkpoint` checks the
    copy it loads). A checkpoint named directly that fails its checksum raises CheckpointError."""
    for resolved in _candidates(uri, storage_cfg, announce):
        problem = _checksum_problem(resolved, storage_cfg) if checksums else None
        if problem and resolved == uri:
            raise checkpoint.CheckpointError(f"checkpoint {uri} cannot be used: {problem}")
        if problem and checkpoint_removed(resolved, storage_cfg):
            continue  # _candidates lists the run's checkpoints again once none is left
        if problem:
            if announce:
                _pass_over(resolved, problem)
            continue
        if announce and resolved != uri:
            print(f"raylm: using checkpoint {resolved}", file=sys.stderr, flush=True)
        return resolved
    raise _none_usable(uri)


def read_newest(uri: str, read: Callable[[str], T], storage_cfg: Optional[StorageConfig] = None,
                checksums: bool = False, announce: bool = True) -> tuple[str, T]:
    """(the checkpoint, `read(checkpoint)`) for the checkpoint `uri` or its run's newest
    (`resolve_checkpoint`), resolved again, up to RELISTS times, when the run removes the one
    resolved before `read` is done with it."""
    relists = 0
    while True:
        resolved = resolve_checkpoint(uri, storage_cfg, announce, checksums)
        try:
            return resolved, read(resolved)
        except (FileNotFoundError, storage.StorageError, checkpoint.CheckpointError):
            relists += 1
            if resolved == uri or relists > RELISTS or not checkpoint_removed(resolved, storage_cfg):
                raise


@contextlib.contextmanager
def held_checkpoint(uri: str, read: Callable[[str], T],
                    storage_cfg: Optional[StorageConfig] = None) -> Iterator[tuple[str, str, T]]:
    """(the checkpoint `uri` or its run's newest sound one, where workers load it from, `read` of
    it), for a driver whose workers load the checkpoint it checked: a local one as a snapshot held
    while the block runs, which the run's removal of it (checkpoint.keep_last) leaves whole; an
    s3:// one where it lies (a copy here would be the whole checkpoint, optimizer state included,
    on this machine's disk), every byte checked there, resolved again if removed before `read`."""
    if storage.is_s3(uri):
        resolved, value = read_newest(uri, read, storage_cfg, checksums=True)
        yield resolved, resolved, value
        return
    with sound_checkpoint(uri, storage_cfg) as (resolved, directory):
        yield resolved, directory, read(directory)


def removed_while_used(uri: str, resolved: str, error: BaseException,
                       storage_cfg: Optional[StorageConfig] = None) -> BaseException:
    """The error to raise for `error`, met by workers loading `resolved`, the newest checkpoint of
    the run `uri`: said plainly when the run removed it meanwhile (checkpoint.keep_last)."""
    if resolved == uri or not checkpoint_removed(resolved, storage_cfg):
        return error
    return checkpoint.CheckpointError(
        f"checkpoint {resolved} was removed by its run while the workers loaded it (the run keeps its "
        f"newest checkpoint.keep_last): the same command takes the run's newest again; a checkpoint the run "
        f"keeps (checkpoint.keep_every) can be named instead")


def checkpoint_removed(candidate: str, storage_cfg: Optional[StorageConfig] = None) -> bool:
    """Whether a checkpoint that had its manifest lost it since: its run removed it (the removal
    deletes the manifest first), which is no damage of it to report."""
    return not storage.exists(storage.join(candidate, checkpoint.MANIFEST), storage_cfg)


def _checksum_problem(uri: str, storage_cfg: Optional[StorageConfig]) -> Optional[str]:
    """The first file of the checkpoint at `uri` that does not match its manifest's size and sha256."""
    try:
        manifest = checkpoint.read_manifest(uri, storage_cfg)
    except checkpoint.CheckpointError as e:
        return str(e)
    return next(filter(None, (checkpoint.file_problem(uri, name, entry, storage_cfg)
                              for name, entry in manifest.items())), None)


def _pass_over(candidate: str, problem: str) -> None:
    print(f"raylm: passing over {candidate}: {problem}", file=sys.stderr, flush=True)


def _none_usable(run_uri: str) -> FileNotFoundError:
    return FileNotFoundError(f"{run_uri}: no checkpoint of this run can be used (each one passed over above)")


def _candidates(uri: str, storage_cfg: Optional[StorageConfig], announce: bool = True) -> Iterator[str]:
    """`uri` if it is a checkpoint; else the complete checkpoints of the run directory `uri`,
    newest first, each finished one passed over named with its reason (if `announce`), listed
    again (up to RELISTS times) when the run removed one of them meanwhile (it saved a newer one).
    Raises when there is none."""
    storage.refuse_file(uri, "a checkpoint directory, or a run directory that holds checkpoints")
    name = uri.rstrip("/").rsplit("/", 1)[-1]
    if checkpoint.is_checkpoint_name(name) or storage.exists(storage.join(uri, checkpoint.TRAIN_STATE), storage_cfg):
        yield uri  # a checkpoint, whole or not: check_sound says what is wrong with it
        return
    problems, found, announced = {}, False, set()
    for _ in range(1 + RELISTS):
        removed = False
        for candidate in checkpoint.checkpoint_uris(uri, storage_cfg):
            if not storage.exists(storage.join(candidate, checkpoint.MANIFEST), storage_cfg):
                problems[candidate] = f"no {checkpoint.MANIFEST} (the save did not finish)"
                continue  # an unfinished save never claimed to be whole: passed over silently
            problem = checkpoint.incomplete_reason(candidate, storage_cfg)
            if problem is None:
                found = True
                yield candidate
                removed = removed or checkpoint_removed(candidate, storage_cfg)  # the caller found it gone
            elif checkpoint_removed(candidate, storage_cfg):
                removed = True
            else:
                problems[candidate] = problem
                if announce and candidate not in announced:
                    _pass_over(candidate, problem)
                    announced.add(candidate)
        if not removed:
            break  # else the run saved a newer one as it removed one listed: list again
    if not found:
        why = "".join(f"\n  {name}: {problem}" for name, problem in problems.items())
        raise FileNotFoundError(f"{uri} is neither a checkpoint nor a run directory holding a complete one" +
                                (f"; its checkpoints cannot be used:{why}" if why else ""))


@contextlib.contextmanager
def sound_checkpoint(uri: str, storage_cfg: Optional[StorageConfig] = None) -> Iterator[tuple[str, str]]:
    """The checkpoint `uri`, or the newest one of the run directory `uri` whose every file matches
    its manifest's checksum, as (its uri, a local directory holding it: for a run's newest, a
    snapshot that the run's removal of it leaves whole); in a run directory a damaged newer one is
    passed over, named with the reason, and the one used is named."""
    for candidate in _candidates(uri, storage_cfg):
        is_run = candidate != uri
        with contextlib.ExitStack() as stack:
            try:
                directory = stack.enter_context(local_checkpoint(candidate, storage_cfg, snapshot=is_run))
            except (FileNotFoundError, storage.StorageError):
                if is_run and checkpoint_removed(candidate, storage_cfg):
                    continue  # removed as it was taken: the run's newer one
                raise
            if not is_run:
                checkpoint.check_sound(directory, candidate, require_manifest=True)
            elif problem := checkpoint.local_problem(directory):  # a run's candidates have their manifest
                if not checkpoint_removed(candidate, storage_cfg):
                    _pass_over(candidate, problem)
                continue
            if is_run:
                print(f"raylm: using checkpoint {candidate}", file=sys.stderr, flush=True)
            yield candidate, directory
            return
    raise _none_usable(uri)


@contextlib.contextmanager
def local_checkpoint(uri: str, storage_cfg: Optional[StorageConfig] = None, snapshot: bool = False) -> Iterator[str]:
    """The checkpoint at `uri` as a local directory (DCP reads files): a temporary copy of an s3://
    one; a local one itself, or with `snapshot` (a run's newest, which the run removes as it saves
    newer ones: checkpoint.keep_last) hard links to its files in a hidden directory beside it, of
    its name (no data copied), which outlive the removal; itself where links cannot be made there
    (another filesystem, no write permission). FileNotFoundError: removed meanwhile."""
    if storage.is_s3(uri):
        with tempfile.TemporaryDirectory(prefix="raylm-checkpoint-") as directory:
            storage.copy_dir(uri, directory, storage_cfg)
            yield directory
        return
    if not snapshot:
        yield uri
        return
    path = os.path.abspath(uri)
    try:
        held = tempfile.mkdtemp(prefix=".reading-", dir=os.path.dirname(path))
    except OSError:  # a directory the reader may not write: read in place
        yield uri
        return
    try:
        linked = os.path.join(held, os.path.basename(path))
        yield linked if _link_tree(path, linked) else uri
    finally:
        shutil.rmtree(held, ignore_errors=True)


def _link_tree(source: str, target: str) -> bool:
    """Hard-link every file below `source` into `target`; False where links cannot be made there."""
    for root, _, files in os.walk(source):
        into = os.path.join(target, os.path.relpath(root, source))
        os.makedirs(into, exist_ok=True)
        for name in files:
            try:
                os.link(os.path.join(root, name), os.path.join(into, name))
            except FileNotFoundError:
                raise
            except OSError:  # EXDEV, EPERM, EMLINK: no snapshot, the files in place
                return False
    if not os.path.isdir(source):
        raise FileNotFoundError(f"{source}: no such checkpoint directory")
    return True


def load_for_inference(uri: str, storage_cfg: Optional[StorageConfig] = None) -> tuple[Transformer, Tokenizer, Config]:
    # One process is the point here; DCP warns that it assumes so.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    with sound_checkpoint(uri, storage_cfg) as (resolved, directory):
        try:
            cfg = saved_config(read_saved_config(directory))
        except ConfigError as e:
            raise ConfigError(f"{uri}: the checkpoint's {CONFIG_FILE} cannot be used: {e}") from e
        model = _build_model(cfg, directory, resolved)
        checkpoint.load_model_weights(directory, model, check=False)
        tokenizer = read_checkpoint_tokenizer(directory, resolved)
    model.eval()
    return model, tokenizer, cfg


def read_checkpoint_tokenizer(directory: str, uri: str, storage_cfg: Optional[StorageConfig] = None) -> Tokenizer:
    """The tokenizer saved in the checkpoint `directory` (a local copy of `uri`, or `uri` itself;
    `uri` names it in errors)."""
    data = storage.read_bytes(storage.join(directory, TOKENIZER_FILE), storage_cfg)
    try:
        return tokenizer_from_json(data.decode("utf-8"), name=storage.join(uri, TOKENIZER_FILE))
    except ValueError as e:  # not UTF-8, not JSON, not a tokenizer
        raise checkpoint.CheckpointError(f"{uri}: its {TOKENIZER_FILE} cannot be used: {e}") from None


def _build_model(cfg: Config, directory: str, uri: str) -> Transformer:
    """The model the saved config describes, built only when the checkpoint's tensors can fill
    it: a config.yaml that claims more parameters than were saved (corrupt, or forged along with
    the manifest) must not make this process allocate them."""
    with open(os.path.join(directory, METADATA_FILE), "rb") as f:
        entries = read_metadata(f.read()).state_dict_metadata  # parsed once already by check_sound
    saved = sum(math.prod(e.size) for name, e in entries.items()
                if name.startswith("model.") and isinstance(e, TensorStorageMetadata))
    m = cfg.model
    # The one allocation the saved tensors do not bound: the RoPE table, max_seq_len x head_dim.
    rope_bytes = 4 * m.max_seq_len * (m.d_model // max(1, m.n_heads)) if m.pos_embedding == "rope" else 0
    available = _available_memory()
    if available is not None and 2 * rope_bytes > available:
        raise checkpoint.CheckpointError(
            f"{uri}: its {CONFIG_FILE} gives model.max_seq_len={m.max_seq_len:,}, whose RoPE table needs "
            f"{rope_bytes / 2**30:,.1f} GiB, more than half this machine's available memory "
            f"({available / 2**30:,.1f} GiB): the config does not belong to these weights")
    try:
        claimed = count_params(m)
        if claimed <= saved:
            return Transformer(m)
    except (ValueError, ArithmeticError, RuntimeError, MemoryError) as e:  # sizes no model can have
        raise checkpoint.CheckpointError(f"{uri}: the model its {CONFIG_FILE} describes cannot be built "
                                         f"({type(e).__name__}: {str(e)[:200]})") from None
    raise checkpoint.CheckpointError(f"{uri}: its {CONFIG_FILE} describes a model of {claimed:,} parameters, "
                                     f"its tensors hold {saved:,}: the config does not belong to these weights")


def _available_memory() -> Optional[int]:
    """Bytes the kernel says can be allocated without swapping (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
