"""Download GPT-2-tokenized FineWeb shards from the Hugging Face hub into data/fineweb10B/.

  python data/cached_fineweb10B.py        # the val shard + the first 10 training shards (about 2.2 GB)
  python data/cached_fineweb10B.py 103    # all of FineWeb10B (about 20.8 GB)

Why 10 by default: train_gpt.py's speedrun preset (record #89) trains 1,285 steps (--preset=record85: 1,290)
in stages of 8 micro-batches of 16,385, 32,769 and 49,153 tokens, and a shard supplies fewer steps than its
100,000,000 tokens suggest: each document gives only its first 896 (first stage) or 2,048 tokens, a micro-batch
skips the rest of the document it ends in, and a step never straddles two shards. Under the synthetic
document-length model of train_gpt.py (exponential, mean 1,000 tokens) the shards supply 436, 325, 247,
218 and 218 steps in turn (counted for record #85's 1,290) (their steps use 59% of the first shard's tokens, 85-86% of the others'), so 5
would do; the public repository's instructions download 9; the default is those 9 and one spare.
train_gpt.py counts the steps of the shards it finds before it starts, and refuses to run short (naming
how many shards to fetch) unless --repeat_data=true.
Every shard is 200,001,024 bytes on disk (1 KiB header + 2 bytes per token).

Shards already present and valid are skipped. A download goes to a hidden staging folder and is
fsynced and moved into place only after its header and size check out, so an interrupted run never
leaves a file that looks complete. A run claims its folder (safe_write.FolderLock): a second download
into the same folder is refused in one line while the first lasts.
"""

import argparse
import os
import shutil
import sys
from pathlib import Path

import safe_write
import shards

REPO_ID = "kjj0/fineweb10B-gpt2"
REPO_TYPE = "dataset"
TRAIN_SHARDS_IN_REPO = 103  # fineweb_train_000001.bin .. fineweb_train_000103.bin
SPEEDRUN_STEPS = 1285  # train_gpt.py's num_iterations
RECORD_TRAIN_SHARDS = 9  # what the public speedrun repository's instructions download
DEFAULT_TRAIN_SHARDS = RECORD_TRAIN_SHARDS + 1  # one spare: the steps a real shard supplies are not measured here
DEFAULT_OUT = Path(__file__).resolve().parent / "fineweb10B"
STAGING = ".download"  # inside the output folder, so that the final move is a same-disk rename
NETWORK_TIMEOUT_S = 10.0


class DownloadError(Exception):
    """An expected failure; main() prints it as one line."""


def shard_names(num_train: int) -> list[str]:
    return ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, num_train + 1)]


def _network_errors() -> tuple:
    """Exception types that mean 'could not talk to the hub' (the HTTP library differs across versions)."""
    errors = [OSError]  # includes the hub's HTTP errors, OfflineModeIsEnabled, requests' errors
    for module in ("httpx2", "httpx"):
        try:
            errors.append(__import__(module).HTTPError)
        except ImportError:
            pass
    return tuple(errors)


def fetch(name: str, out_dir: Path) -> str:
    """Download one shard into out_dir unless a valid copy is there; returns what happened."""
    final = out_dir / name
    if final.exists():
        try:
            shards.check_shard(final)
            return "present, skipped"
        except shards.ShardError as e:
            print(f"warning: {e}; downloading it again", file=sys.stderr)

    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.errors import (EntryNotFoundError, LocalEntryNotFoundError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError)

    where = f"from the Hugging Face hub ({REPO_ID})"
    staging = out_dir / STAGING
    try:
        # One quick request without retries first: offline, hf_hub_download would retry for ~25 s.
        meta = get_hf_file_metadata(hf_hub_url(REPO_ID, name, repo_type=REPO_TYPE), timeout=NETWORK_TIMEOUT_S)
        path = Path(hf_hub_download(REPO_ID, name, repo_type=REPO_TYPE, local_dir=staging,
                                    etag_timeout=NETWORK_TIMEOUT_S))
    except OfflineModeIsEnabled:
        raise DownloadError(f"could not download {name} {where}: HF_HUB_OFFLINE is set; unset it to download") from None
    except (EntryNotFoundError, RepositoryNotFoundError) as e:
        if isinstance(e, LocalEntryNotFoundError):  # "not in the local cache": a network failure
            raise DownloadError(f"could not download {name} {where}: no network connection? "
                                f"Retry when online (see --help)") from None
        raise DownloadError(f"{name} is not in the dataset repo {REPO_ID} ({type(e).__name__}); "
                            f"it holds {TRAIN_SHARDS_IN_REPO} training shards") from None
    except _network_errors() as e:
        detail = str(e).splitlines()[0] if str(e) else "no details"
        raise DownloadError(f"could not download {name} {where}: no network connection? "
                            f"Retry when online (see --help) ({type(e).__name__}: {detail})") from None

    try:
        shards.check_shard(path)
        if meta.size is not None and path.stat().st_size != meta.size:
            raise shards.ShardError(f"{path}: {path.stat().st_size} bytes, the hub says {meta.size}")
    except shards.ShardError as e:
        path.unlink(missing_ok=True)  # so that the next run downloads it afresh
        raise DownloadError(f"downloaded {name} is damaged ({e}); it was deleted, run again to retry") from None
    try:
        safe_write.commit(path, final)  # fsynced, then renamed; removed if that fails
    except OSError as e:
        raise DownloadError(f"cannot write {final}: {e.strerror or e}; run again to retry") from None
    except safe_write.FileRefused as e:  # a link, a FIFO or a device where the shard goes: left as it is
        raise DownloadError(str(e)) from None
    return f"downloaded, {final.stat().st_size:,} bytes"


def fetch_all(names: list[str], out_dir: Path):
    """Fetches each shard in turn; prints one line per shard. The staging folder is removed at the end, and
    after a failure too unless it holds a partial download that the next run resumes from."""
    staging = out_dir / STAGING
    try:
        for i, name in enumerate(names, 1):
            print(f"[{i}/{len(names)}] {name}: {fetch(name, out_dir)}", flush=True)
    except BaseException:
        if staging.is_dir() and not any(p.suffix in (".bin", ".incomplete") for p in staging.rglob("*")):
            shutil.rmtree(staging, ignore_errors=True)  # no partial download worth resuming from
        raise
    shutil.rmtree(staging, ignore_errors=True)  # only hub metadata is left there


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=f"Download GPT-2-tokenized FineWeb10B shards ({REPO_ID} on the Hugging Face hub).",
        epilog=f"Default {DEFAULT_TRAIN_SHARDS}: record #44's {RECORD_TRAIN_SHARDS} and a spare, for the speedrun's "
               f"{SPEEDRUN_STEPS:,} steps (train_gpt.py counts the steps its shards supply before it starts). "
               f"Each shard takes 200,001,024 bytes on disk.")
    parser.add_argument("num_train", nargs="?", type=int, default=DEFAULT_TRAIN_SHARDS, metavar="N",
                        help=f"training shards to fetch, 0..{TRAIN_SHARDS_IN_REPO} (default {DEFAULT_TRAIN_SHARDS}); "
                             "the val shard is always fetched")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="destination folder (default: data/fineweb10B next to this script)")
    args = parser.parse_args(argv)
    if not 0 <= args.num_train <= TRAIN_SHARDS_IN_REPO:
        parser.error(f"N must be between 0 and {TRAIN_SHARDS_IN_REPO} (the repo's training shards), "
                     f"got {args.num_train}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    # Fail fast offline: the hub's default timeouts are long. Must be set before huggingface_hub is imported.
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", str(int(NETWORK_TIMEOUT_S)))
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", str(int(NETWORK_TIMEOUT_S)))
    names = shard_names(args.num_train)
    created_out = not args.out.exists()
    try:
        if args.out.exists() and not args.out.is_dir():
            raise DownloadError(f"--out {args.out}: exists and is not a folder")
        args.out.mkdir(parents=True, exist_ok=True)
        with safe_write.FolderLock(args.out, f"--out {args.out}"):  # one downloader per folder
            fetch_all(names, args.out)
    except (DownloadError, safe_write.LockError, OSError, KeyboardInterrupt, SystemExit) as e:
        if created_out and args.out.is_dir() and not any(args.out.iterdir()):
            args.out.rmdir()  # a failed first run leaves no trace
        if isinstance(e, SystemExit):  # SIGTERM, while the lock is held (safe_write.sigterm_exits)
            print("error: terminated; finished shards are kept, run again to resume", file=sys.stderr)
            raise
        if isinstance(e, KeyboardInterrupt):
            print("error: interrupted; finished shards are kept, run again to resume", file=sys.stderr)
            return 130
        if isinstance(e, OSError):  # the hub's are DownloadErrors by now: this is the folder (mkdir, its lock)
            e = f"--out {args.out}: cannot write there ({e.strerror or e})"
        print(safe_write.visible(f"error: {e}"), file=sys.stderr)
        return 1
    print(f"{len(names)} shards in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
