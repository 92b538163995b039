"""HellaSwag's validation set: download it, read it, and score a language model on it.

  python data/hellaswag.py                                  # downloads data/hellaswag/hellaswag_val.jsonl (11 MB)
  python sample.py <final folder> --eval=hellaswag          # scores a model trained by train_gpt.py

An example is a context and four endings, one of them right. Scored completion-style, as llm.c's
dev/data/hellaswag.py does for its GPT-2 reproductions: the model reads each `context + " " + ending`
as one document, and an ending's score is the loss of its tokens given everything before them.
  acc_norm: the ending with the lowest mean loss per token is chosen (the headline number);
  acc:      the ending with the lowest summed loss is chosen (it favours short endings).
Ties go to the first ending. Random guessing scores 0.25.

Reference, GPT-2 small (124M, OpenAI's weights), all 10,042 examples, this protocol: acc 0.2859,
acc_norm 0.2955, from the docstring of llm.c's dev/data/hellaswag.py (github.com/karpathy/llm.c).

The file comes from the dataset's public source, the HellaSwag authors' GitHub repository
(rowanz/hellaswag, data/hellaswag_val.jsonl). It is written to a temporary file beside --out, fsynced and
renamed only after all 10,042 examples parse (data/safe_write.py's atomic_file), so an interrupted or failed
download never leaves a file that looks complete, nor the temporary.
Offline it fails at once with one line and exit code 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import safe_write  # data/, beside this file

SOURCE_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
DEFAULT_PATH = Path(__file__).resolve().parent / "hellaswag" / "hellaswag_val.jsonl"
VAL_EXAMPLES = 10_042
NUM_ENDINGS = 4
NETWORK_TIMEOUT_S = 10.0


class HellaSwagError(Exception):
    """Expected failures (missing or malformed file, no network): printed as one line."""


@dataclass(frozen=True)
class Example:
    context: str
    endings: tuple[str, ...]
    label: int


@dataclass(frozen=True)
class Result:
    examples: int
    correct: int  # lowest summed loss
    correct_norm: int  # lowest mean loss per token

    @property
    def acc(self) -> float:
        return self.correct / self.examples

    @property
    def acc_norm(self) -> float:
        return self.correct_norm / self.examples


# -----------------------------------------------------------------------------
# Reading

def parse_example(line: str, where: str) -> Example:
    """One jsonl line: needs "ctx" (non-empty), "endings" (4 non-empty strings) and "label" (0..3)."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise HellaSwagError(f"{where}: not JSON ({e.msg})") from None
    except RecursionError:  # nested thousands deep: the parser's own limit, a traceback otherwise
        raise HellaSwagError(f"{where}: not a HellaSwag example (JSON nested too deeply)") from None
    if not isinstance(item, dict):
        raise HellaSwagError(f"{where}: expected a JSON object")
    context, endings, label = item.get("ctx"), item.get("endings"), item.get("label")
    if not isinstance(context, str) or not context.strip():
        raise HellaSwagError(f"{where}: \"ctx\" must be a non-empty string")
    if (not isinstance(endings, list) or len(endings) != NUM_ENDINGS
            or not all(isinstance(e, str) and e.strip() for e in endings)):
        raise HellaSwagError(f"{where}: \"endings\" must be a list of {NUM_ENDINGS} non-empty strings")
    if isinstance(label, str) and label.isdigit():  # some copies store the label as a string
        label = int(label)
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < NUM_ENDINGS:
        raise HellaSwagError(f"{where}: \"label\" must be 0..{NUM_ENDINGS - 1}, got {label!r}")
    return Example(context, tuple(endings), label)


def read_examples(path: Path, limit: int | None = None) -> list[Example]:
    """The first `limit` examples (all if None); blank lines are skipped."""
    examples = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(examples) == limit:
                break
            if line.strip():
                examples.append(parse_example(line, f"{path}:{number}"))
    return examples


def load_examples(path=DEFAULT_PATH, limit: int | None = None) -> list[Example]:
    path = Path(path)
    # Only a folder or a missing path is refused up front: a pipe (/dev/stdin, a FIFO, <(...)) is read
    # like a file, once, from its start.
    if path.is_dir():
        raise HellaSwagError(f"{path}: a directory, not a HellaSwag .jsonl file")
    if not path.exists():
        hint = " (download it with `python data/hellaswag.py`)" if path == DEFAULT_PATH else ""
        raise HellaSwagError(f"{path}: no such file{hint}")
    try:
        examples = read_examples(path, limit)
    except UnicodeDecodeError:
        raise HellaSwagError(f"{path}: not UTF-8 text") from None
    except OSError as e:
        raise HellaSwagError(f"{path}: cannot read ({e.strerror or e})") from None
    if not examples:
        raise HellaSwagError(f"{path}: holds no examples")
    return examples


# -----------------------------------------------------------------------------
# Scoring

def render(example: Example, encoding) -> tuple[list[int], list[list[int]]]:
    """Context tokens, and each ending's tokens (encoded with its leading space, after the context)."""
    return (encoding.encode_ordinary(example.context),
            [encoding.encode_ordinary(" " + ending) for ending in example.endings])


def choose(ending_losses: list) -> tuple[int, int]:
    """(index by lowest summed loss, index by lowest mean loss); ties go to the first ending."""
    sums = [float(losses.sum()) for losses in ending_losses]
    means = [total / len(losses) for total, losses in zip(sums, ending_losses)]
    return sums.index(min(sums)), means.index(min(means))


def evaluate(examples: list[Example], token_losses, encoding, batch_size: int = 8, progress: bool = True,
             max_tokens: int | None = None) -> Result:
    """Scores the examples, batch_size at a time (4 sequences each).

    token_losses(sequences) takes lists of token ids and returns, per sequence, a tensor of len(seq) - 1
    losses: entry j is the loss of seq[j + 1] given seq[:j + 1], each sequence read as its own document
    (sample.py's token_losses_fn packs them into as few forward passes as the model allows). An example
    whose context and ending are longer than max_tokens is an error, found before any scoring."""
    from tqdm import tqdm

    rendered = [render(example, encoding) for example in examples]
    if max_tokens is not None:
        for number, (context, endings) in enumerate(rendered, 1):
            longest = len(context) + max(len(ending) for ending in endings)
            if longest > max_tokens:
                raise HellaSwagError(f"example {number}: its context and longest ending are {longest} tokens, "
                                     f"more than the model reads ({max_tokens})")
    correct = correct_norm = 0
    with tqdm(total=len(examples), unit="example", desc="hellaswag", disable=not progress) as bar:
        for start in range(0, len(examples), batch_size):
            batch = examples[start:start + batch_size]
            sequences, ending_lengths = [], []
            for context, endings in rendered[start:start + batch_size]:
                for ending in endings:
                    sequences.append(context + ending)
                    ending_lengths.append(len(ending))
            losses = token_losses(sequences)
            for i, example in enumerate(batch):
                rows = range(i * NUM_ENDINGS, (i + 1) * NUM_ENDINGS)
                by_sum, by_mean = choose([losses[r][len(losses[r]) - ending_lengths[r]:] for r in rows])
                correct += by_sum == example.label
                correct_norm += by_mean == example.label
            bar.update(len(batch))
            bar.set_postfix(acc_norm=f"{correct_norm / (start + len(batch)):.4f}")
    return Result(len(examples), correct, correct_norm)


def format_result(result: Result) -> str:
    return (f"hellaswag: {result.examples} examples  acc_norm {result.acc_norm:.4f} ({result.correct_norm} right, "
            f"lowest mean loss per token)  acc {result.acc:.4f} ({result.correct} right, lowest summed loss)")


# -----------------------------------------------------------------------------
# Download

def download(out: Path = DEFAULT_PATH, url: str = SOURCE_URL, expected_examples: int = VAL_EXAMPLES) -> str:
    """Fetches the file unless a complete copy is there; returns what happened."""
    if out.is_file():
        try:
            if len(read_examples(out)) == expected_examples:
                return "present, skipped"
        except (HellaSwagError, UnicodeDecodeError):
            pass
        print(f"warning: {out} is incomplete or damaged; downloading it again", file=sys.stderr)
    if out.exists() and not out.is_file():
        raise HellaSwagError(f"--out {out}: exists and is not a file")
    created_dir = not out.parent.exists()
    try:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            with safe_write.atomic_file(out) as f:  # renamed to out only if the block ends without an error
                found = _download_into(f, url, expected_examples)
        except OSError as e:  # the network's errors are HellaSwagErrors by now: this is the disk
            raise HellaSwagError(f"--out {out}: cannot write there ({e.strerror or e})") from None
        except safe_write.FileRefused as e:  # a link, a FIFO or a device where the file goes: left as it is
            raise HellaSwagError(f"--out {e}") from None
    except BaseException:
        if created_dir and out.parent.is_dir() and not any(out.parent.iterdir()):
            out.parent.rmdir()  # a failed first run leaves no trace
        raise
    return f"downloaded, {found:,} examples, {out.stat().st_size:,} bytes"


def _download_into(f, url: str, expected_examples: int) -> int:
    """Writes url's file to f and checks it: returns its number of examples, which must be expected_examples."""
    try:
        response = urllib.request.urlopen(url, timeout=NETWORK_TIMEOUT_S)
    except urllib.error.HTTPError as e:
        raise HellaSwagError(f"could not download {url}: the server answered HTTP {e.code} {e.reason}") from None
    except OSError as e:  # URLError, refused connections and timeouts are all OSErrors
        reason = str(getattr(e, "reason", None) or e).splitlines()
        raise HellaSwagError(f"could not download {url}: no network connection? Retry when online "
                             f"({type(e).__name__}: {reason[0] if reason else 'no details'})") from None
    with response:
        _copy_with_progress(response, f, url)
    f.flush()
    try:
        found = len(read_examples(Path(f.name)))
    except UnicodeDecodeError:
        raise HellaSwagError(f"downloaded {url} is not UTF-8 text; run again to retry") from None
    except HellaSwagError as e:
        raise HellaSwagError(f"downloaded file is damaged ({e}); run again to retry") from None
    if found != expected_examples:
        raise HellaSwagError(f"downloaded {url} holds {found} examples, expected {expected_examples}; "
                             f"run again to retry")
    return found


def _copy_with_progress(response, f, url: str):
    """Copies the response into f. A failed read is the network's (a HellaSwagError); a failed write, an
    OSError, is the disk's."""
    from tqdm import tqdm

    size = response.headers.get("Content-Length")
    with tqdm(total=int(size) if size else None, unit="B", unit_scale=True, desc="hellaswag_val.jsonl",
              disable=not sys.stderr.isatty()) as bar:
        while True:
            try:
                block = response.read(1 << 16)
            except OSError as e:
                raise HellaSwagError(f"downloading {url} failed midway ({type(e).__name__}: {e}); "
                                     f"run again to retry") from None
            if not block:
                return
            f.write(block)
            bar.update(len(block))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Download HellaSwag's validation set (10,042 examples) from its "
                                                 "public source, github.com/rowanz/hellaswag.")
    parser.add_argument("--out", type=Path, default=DEFAULT_PATH,
                        help="where to write it (default: data/hellaswag/hellaswag_val.jsonl)")
    args = parser.parse_args(argv)
    try:
        print(f"{args.out}: {download(args.out)}")
    except HellaSwagError as e:
        print(safe_write.visible(f"error: {e}"), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted; nothing was kept, run again", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
