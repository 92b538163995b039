"""data/hellaswag.py: reading, scoring (against a hand-worked fixture), download failures, and
sample.py --eval=hellaswag on a real model."""

import os
import sys
import threading

import pytest
import torch
from torch.testing import assert_close

import sample
from conftest import REPO, in_process, one_line_error, python, random_model

sys.path.insert(0, str(REPO / "data"))
import hellaswag  # noqa: E402

FIXTURE = REPO / "tests/fixtures/hellaswag/tiny_val.jsonl"
SCRIPT = REPO / "data/hellaswag.py"


class WordLengths:
    """Stand-in tokenizer: one token per word, its id the word's length."""

    @staticmethod
    def encode_ordinary(text):
        return [len(word) for word in text.split()]


def loss_is_token_id(sequences):
    """Stand-in scorer: the loss of each predicted token is its id (for WordLengths, its word's length)."""
    return [torch.tensor(seq[1:], dtype=torch.float32) for seq in sequences]


def test_fixture_scores_as_worked_out_by_hand():
    # Summed / mean loss of each ending (word lengths), in the fixture's order; * marks the label.
    #   1: *8/2.00   7/7.00   9/3.00  12/4.00   sum picks 2, mean picks 1*
    #   2:  6/3.00   8/4.00  *4/2.00   6/6.00   both pick 3*
    #   3: 11/3.67   8/4.00   6/6.00 *10/1.00   sum picks 3, mean picks 4*
    #   4:  4/2.00  *4/2.00   5/5.00   6/6.00   ties: both pick 1
    #   5: *2/2.00   9/3.00   8/8.00  13/6.50   both pick 1* (counting the context's last word, 20 letters, would make mean pick 2)
    examples = hellaswag.load_examples(FIXTURE)
    assert [e.label for e in examples] == [0, 2, 3, 1, 0]
    for batch_size in (1, 2, 5, 64):
        result = hellaswag.evaluate(examples, loss_is_token_id, WordLengths(), batch_size=batch_size, progress=False)
        assert (result.examples, result.correct, result.correct_norm) == (5, 2, 4)
        assert (result.acc, result.acc_norm) == (0.4, 0.8)
    limited = hellaswag.evaluate(hellaswag.load_examples(FIXTURE, limit=2), loss_is_token_id, WordLengths(),
                                 progress=False)
    assert (limited.examples, limited.correct, limited.correct_norm) == (2, 1, 2)
    assert "acc_norm 0.8000" in hellaswag.format_result(result)


def test_rendering_uses_gpt2_tokens_with_a_space_before_each_ending():
    encoding = sample.load_tokenizer()
    context, endings = hellaswag.render(hellaswag.load_examples(FIXTURE)[1], encoding)
    assert encoding.decode(context) == "A woman cracks eggs into a bowl. She"
    assert [encoding.decode(e) for e in endings] == [" x yyyyy", " zzzz zzzz", " ab ab", " abcdef"]


@pytest.mark.parametrize("line, message", [
    ("{not json", "not JSON"),
    ('{"ctx": ' + "[" * 100_000 + "]" * 100_000 + "}", "JSON nested too deeply"),  # issue 38 row 8: a traceback
    ('{"ctx": "", "endings": ["a", "b", "c", "d"], "label": 0}', '"ctx" must be'),
    ('{"ctx": "x", "endings": ["a", "b", "c"], "label": 0}', '"endings" must be'),
    ('{"ctx": "x", "endings": ["a", "b", "c", "d"], "label": 4}', '"label" must be 0..3'),
    ('{"ctx": "x", "endings": ["a", "b", "c", "d"]}', '"label" must be 0..3'),
])
def test_malformed_lines_are_named(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(FIXTURE.read_text().splitlines()[0] + "\n" + line + "\n")
    with pytest.raises(hellaswag.HellaSwagError, match=rf"bad.jsonl:2: .*{message}"):
        hellaswag.load_examples(path)
    with pytest.raises(hellaswag.HellaSwagError, match="no such file"):
        hellaswag.load_examples(tmp_path / "missing.jsonl")


def test_a_fifo_is_read_and_a_folder_is_called_one(tmp_path):
    fifo = tmp_path / "val.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=fifo.write_bytes, args=(FIXTURE.read_bytes(),))
    writer.start()  # its open waits for a reader
    try:
        assert hellaswag.load_examples(fifo) == hellaswag.load_examples(FIXTURE)
    finally:
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # never waits; frees a writer still waiting
        writer.join()
        os.close(reader)
    with pytest.raises(hellaswag.HellaSwagError, match=rf"^{tmp_path}: a directory, not a HellaSwag .jsonl file$"):
        hellaswag.load_examples(tmp_path)


@pytest.mark.slow
def test_download_offline_fails_in_one_line_and_leaves_nothing(tmp_path):
    out = tmp_path / "hs" / "hellaswag_val.jsonl"
    # Port 9 (discard) on localhost refuses at once: the same path as having no network.
    with pytest.raises(hellaswag.HellaSwagError, match="could not download .* no network connection"):
        hellaswag.download(out, url="http://127.0.0.1:9/hellaswag_val.jsonl")
    assert not (tmp_path / "hs").exists()
    # the script itself, as a user runs it here (CI has no route to GitHub)
    proc = python(SCRIPT, f"--out={out}", timeout=120)
    assert proc.returncode == 1 and not out.parent.exists()
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr


def test_download_checks_the_file_before_keeping_it(tmp_path):
    out = tmp_path / "hellaswag_val.jsonl"
    with pytest.raises(hellaswag.HellaSwagError, match="holds 5 examples, expected 10042"):
        hellaswag.download(out, url=FIXTURE.as_uri())
    assert list(tmp_path.iterdir()) == []  # neither the file nor its .partial
    assert hellaswag.download(out, url=FIXTURE.as_uri(), expected_examples=5).startswith("downloaded, 5 examples")
    assert out.read_bytes() == FIXTURE.read_bytes()
    assert hellaswag.download(out, url="http://127.0.0.1:9/x", expected_examples=5) == "present, skipped"


def test_packed_sequences_score_as_if_each_were_alone():
    """sample.py packs a batch's sequences into one forward pass; each must score exactly as alone
    (attention, the smear gate, the bigram hash, the key offset, the rotary positions and the first prediction
    all start afresh at the BOS between them)."""
    model, args, info = random_model()
    token_losses = sample.token_losses_fn(model, args, info)
    sequences = [[464, 3290, 11, 257], [50, 60, 70], [1110, 13, 257, 3290, 11, 464, 99], [5, 6]]
    packed = token_losses(sequences)
    for seq, losses in zip(sequences, packed):
        assert losses.shape == (len(seq) - 1,)
        assert_close(losses, token_losses([seq])[0], rtol=1e-6, atol=1e-6)
    # and the losses are the model's: the mean over a lone sequence equals its forward loss
    seq = torch.tensor([sample.T.BOS_ID, *sequences[2]])
    windows = tuple(info["windows"])
    with torch.no_grad():
        masks = sample.T.build_masks(seq[:-1], model.plans, windows, args.window_block, use_flex=False)
        full = model.token_losses(seq[:-1], seq[1:], masks).float()
    assert_close(token_losses([sequences[2]])[0], full[1:], rtol=1e-5, atol=1e-5)


def test_sample_eval_hellaswag_on_the_fixture(untrained_final_folder):
    def run(*extra):
        proc = in_process(sample.main, untrained_final_folder, "--eval=hellaswag", f"--data={FIXTURE}", *extra)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.strip()

    whole = run("--batch_size=5")
    assert whole.startswith("hellaswag: 5 examples  acc_norm ")
    assert run("--batch_size=1") == whole  # batching does not change any choice
    assert run("--limit=2").startswith("hellaswag: 2 examples")
    missing = in_process(sample.main, untrained_final_folder, "--eval=hellaswag",
                         f"--data={FIXTURE.parent / 'nope.jsonl'}")
    one_line_error(missing, "nope.jsonl: no such file")

