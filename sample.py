"""Use a trained model: sample text from it, or score it on HellaSwag.

    python sample.py checkpoints/<run_id>/final --prompt="ROMEO:" --max_new_tokens=50 --seed=1
    python sample.py checkpoints/<run_id>/final --prompt="The" --temperature=0       # greedy
    python sample.py checkpoints/<run_id>/final --eval=hellaswag --limit=1000 --batch_size=16

The folder is what `train_gpt.py --save_final=true` writes. The model is built by train_gpt.py (one
definition of it) and reads text with the bundled GPT-2 BPE (data/gpt2.tiktoken), offline. A prompt
is one document: it starts with <|endoftext|> as every training document did, and generation stops
at the next <|endoftext|>, at --max_new_tokens, or when the context is full (train_gpt.context_length:
the longest document the model trained on, within its rotary tables). Generation keeps a cache of
keys and values, so each new token costs one position's forward, not the whole sequence's;
--no_cache recomputes everything (for checking: under greedy decoding both give the same tokens).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO / "data"))
import hellaswag  # noqa: E402  (data/hellaswag.py)
import tokenize_text  # noqa: E402  (data/tokenize_text.py: GPT-2's BPE from the bundled ranks file)
import train_gpt as T  # noqa: E402


class SampleError(Exception):
    """Bad input: printed as one `error: ...` line."""


class OverflowingWeights(SampleError):
    """Non-finite logits or losses from a model that passed the probe (train_gpt.check_forward_finite): its weights
    overflow on this text. main() names the weights file."""


def check_finite(values: torch.Tensor, what: str):
    if not bool(torch.isfinite(values).all()):
        raise OverflowingWeights(f"the model's {what} are not finite: its weights overflow on this text")


def load_tokenizer():
    """GPT-2's BPE from data/gpt2.tiktoken: never downloaded."""
    try:
        return tokenize_text.load_encoding(tokenize_text.BUNDLED_BPE, flag=None)  # sample.py has no --bpe-file
    except tokenize_text.TokenizeError as e:
        raise SampleError(str(e)) from None


class Generator:
    """Next-token logits for a growing single-document sequence, with or without a KV cache."""

    def __init__(self, model: T.GPT, args: T.Hyperparameters, windows: tuple[int, int], context: int,
                 use_cache: bool):
        self.model, self.context, self.use_cache = model, context, use_cache
        self.windows, self.block = windows, args.window_block
        self.tokens: list[int] = []
        self.caches = T.KVCache(model, context) if use_cache else None

    @torch.no_grad()
    def feed(self, new_tokens: list[int]) -> torch.Tensor:
        """Appends tokens; returns the logits (fp32) that predict the token after them."""
        device = self.model.embed.weight.device
        self.tokens += new_tokens
        if not self.use_cache:
            ids = torch.tensor(self.tokens, device=device)
            masks = T.build_masks(ids, self.model.plans, self.windows, self.block, use_flex=False)
            hidden = self.model.hidden(ids, masks)
        else:
            # the cached layers build their masks from the document ids of every position so far
            masks = T.Masks({}, T.document_ids(torch.tensor(self.tokens, device=device)), self.windows)
            hidden = self.model.hidden(torch.tensor(new_tokens, device=device), masks, self.caches)
        return self.model.logits(hidden[:, -1:])[0, 0].float()


def choose(logits: torch.Tensor, temperature: float, top_k: int, rng: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    # Shifted so that the largest is 0, and divided in float64: a tiny temperature then sends the
    # others to -inf (greedy, ties shared), where logits / temperature in float32 would be inf - inf.
    logits = ((logits - logits.max()).double() / temperature).float()
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, -1).cpu(), 1, generator=rng))


def generate(model: T.GPT, args: T.Hyperparameters, info: dict, prompt_tokens: list[int], max_new_tokens: int,
             temperature: float, top_k: int, seed: int, use_cache: bool = True) -> tuple[list[int], str]:
    """The continuation's tokens, and why generation stopped."""
    context = T.context_length(args)
    ids = [T.BOS_ID] + prompt_tokens
    if len(ids) > context:
        raise SampleError(f"--prompt: {len(prompt_tokens)} tokens (+1 for <|endoftext|>) exceed the model's context "
                          f"of {context} tokens")
    gen = Generator(model, args, tuple(info["windows"]), context, use_cache)
    rng = torch.Generator().manual_seed(seed)
    logits = gen.feed(ids)
    out: list[int] = []
    vocab = args.vocab_size  # the padded logits beyond GPT-2's vocabulary are never sampled
    while True:
        if len(out) == max_new_tokens:
            return out, "max_new_tokens"
        check_finite(logits, f"logits after {len(gen.tokens)} tokens")
        token = choose(logits[:vocab], temperature, top_k, rng)
        if token == T.BOS_ID:
            return out, "<|endoftext|>"
        out.append(token)
        if len(gen.tokens) == context:
            return out, f"the context is full ({context} tokens)"
        logits = gen.feed([token])


def pack(sequences: list[list[int]], limit: int) -> list[list[list[int]]]:
    """Consecutive sequences in groups that each fit one forward pass: a BOS and the sequence, per
    sequence, at most `limit` positions in all."""
    groups, length = [], limit
    for seq in sequences:
        if len(seq) + 1 > limit:
            raise SampleError(f"a sequence of {len(seq)} tokens (+1 for <|endoftext|>) exceeds the model's "
                              f"{limit} positions")
        if length + len(seq) + 1 > limit:
            groups.append([])
            length = 0
        groups[-1].append(seq)
        length += len(seq) + 1
    return groups


def token_losses_fn(model: T.GPT, args: T.Hyperparameters, info: dict):
    """For data/hellaswag.py: per-position losses of several sequences, packed into as few forward passes
    as the model's positions allow (so a batch of any size fits). Each sequence starts its own document
    (a BOS in front), so attention and the smear gate keep them apart and each scores exactly as it
    would alone."""
    windows = tuple(info["windows"])
    device = model.embed.weight.device

    @torch.no_grad()
    def packed_losses(sequences):
        packed = torch.tensor([t for seq in sequences for t in [T.BOS_ID, *seq]] + [T.BOS_ID], device=device)
        inputs, targets = packed[:-1], packed[1:]
        masks = T.build_masks(inputs, model.plans, windows, args.window_block, use_flex=False)
        losses = model.token_losses(inputs, targets, masks, separate_documents=True).float().cpu()
        check_finite(losses, "losses on HellaSwag")
        out, start = [], 0
        for seq in sequences:  # drop the prediction of each sequence's first token from its BOS
            out.append(losses[start + 1:start + len(seq)])
            start += len(seq) + 1
        return out

    def token_losses(sequences):
        return [losses for group in pack(sequences, T.max_positions(args)) for losses in packed_losses(group)]
    return token_losses


def parse_args(argv):
    parser = argparse.ArgumentParser(description="Sample from, or evaluate, a model trained by train_gpt.py.")
    parser.add_argument("folder", help="final-weights folder: <checkpoint_dir>/<run_id>/final")
    parser.add_argument("--prompt", help="text to continue")
    parser.add_argument("--max_new_tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    parser.add_argument("--top_k", type=int, default=200, help="sample among the k likeliest tokens (0: all)")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--no_cache", action="store_true", help="recompute the whole sequence for each token")
    parser.add_argument("--eval", choices=["hellaswag"], help="score the model instead of sampling")
    parser.add_argument("--data", help="HellaSwag jsonl (default: data/hellaswag/hellaswag_val.jsonl, "
                                       "which `python data/hellaswag.py` downloads)")
    parser.add_argument("--limit", type=int, default=0, help="score only the first N examples (0: all)")
    parser.add_argument("--batch_size", type=int, default=8, help="examples per forward pass")
    options = parser.parse_args(argv)
    for name in ("max_new_tokens", "top_k", "limit"):
        if getattr(options, name) < 0:
            raise SampleError(f"--{name}={getattr(options, name)}: must be zero or positive")
    if not 0 <= options.temperature < math.inf:
        raise SampleError(f"--temperature={options.temperature}: must be zero (greedy) or a finite positive number")
    if not 0 <= options.seed < 2 ** 64:  # what torch.Generator.manual_seed takes, negatives aside (they alias)
        raise SampleError(f"--seed={options.seed}: must be in 0..2**64-1")
    if options.batch_size <= 0:
        raise SampleError(f"--batch_size={options.batch_size}: must be positive")
    if options.eval is None and not options.prompt:
        raise SampleError("--prompt: give a non-empty prompt (or --eval=hellaswag)")
    return options


def main(argv=None) -> int:
    try:
        options = parse_args(sys.argv[1:] if argv is None else argv)
        use_cuda = options.device == "cuda" or (options.device == "auto" and torch.cuda.is_available())
        if use_cuda and not torch.cuda.is_available():
            raise SampleError("--device=cuda but no CUDA device is available")
        device = torch.device("cuda" if use_cuda else "cpu")
        model, args, info = T.load_final_weights(options.folder, device)
        problem = T.check_forward_finite(model, args, tuple(info["windows"]))
        if problem:  # weights within MAX_WEIGHT that overflow still
            raise SampleError(f"{Path(options.folder) / 'model.pt'}: these weights are finite, but {problem}")
        encoding = load_tokenizer()
        if options.eval == "hellaswag":
            examples = hellaswag.load_examples(options.data or hellaswag.DEFAULT_PATH, limit=options.limit or None)
            result = hellaswag.evaluate(examples, token_losses_fn(model, args, info), encoding,
                                        batch_size=options.batch_size, max_tokens=T.max_positions(args) - 1)
            print(hellaswag.format_result(result))
            return 0
        prompt_tokens = encoding.encode_ordinary(options.prompt)
        tokens, reason = generate(model, args, info, prompt_tokens, options.max_new_tokens, options.temperature,
                                  options.top_k, options.seed, use_cache=not options.no_cache)
        print(options.prompt + encoding.decode(tokens))
        print(f"[{len(tokens)} tokens; stopped at {reason}]", file=sys.stderr)
        return 0
    except OverflowingWeights as e:
        T.console_line(f"error: {Path(options.folder) / 'model.pt'}: {e}", sys.stderr)
        return 2
    except (SampleError, T.ConfigError, T.DataError, hellaswag.HellaSwagError) as e:
        T.console_line(f"error: {e}", sys.stderr)  # (names and text it did not write, escaped)
        return 2


if __name__ == "__main__":
    sys.exit(main())
