"""Tasks on real reasoning-gym data, JSONL tasks, rewards and the chat template."""

import json
import sys

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from fp4rl.config import TaskConfig
from fp4rl.tasks import (
    EXTRACT_MODES,
    JsonlTask,
    Prompt,
    apply_chat_template,
    extract_answer,
    load_reward,
    load_task,
    math_reward,
    number_reward,
    split_heldout,
    task_from_config,
)

ONE_DIGIT = dict(
    min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=["+", "-"], allow_parentheses=False
)


@pytest.fixture(scope="module")
def arithmetic():
    return load_task("basic_arithmetic", ONE_DIGIT, eval_size=100, pool_size=2000, seed=0)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is 7.", "7"),
        ("0 - 4 = -4", "-4"),
        ("9-4=5", "5"),
        ("9-4", "4"),
        ("That is 1,000 apples", "1000"),
        ("1, 2, 3", "3"),
        ("x = 3.5.", "3.5"),
        ("it is .5", "0.5"),
        ("so -.25", "-0.25"),
        ("wait...5", "5"),
        ("\u22123", "-3"),
        ("no digits here", None),
    ],
)
def test_extract_last_number(text, expected):
    assert extract_answer(text) == expected


def test_extract_other_modes():
    text = "<answer>1</answer> wait\n<answer> 6*(9-5) </answer>\n\nfinal line \n"
    assert extract_answer(text, "answer_tag") == "6*(9-5)"
    assert extract_answer(text, "last_line") == "final line"
    assert extract_answer("  x \n", "full") == "x"
    assert extract_answer("no tag", "answer_tag") is None
    with pytest.raises(ValueError, match="last_number"):
        extract_answer("1", "first_number")


def test_heldout_split_of_the_small_arithmetic_space(arithmetic):
    assert arithmetic.sizes == {"drawn": 2000, "distinct": 242, "train": 142, "eval": 100}
    train_q = {p.question for p in arithmetic.train}
    eval_q = {p.question for p in arithmetic.eval}
    assert len(train_q) == 142 and len(eval_q) == 100 and not train_q & eval_q
    assert all(p.question.endswith(". Answer with the number only.") for p in arithmetic.train)
    assert "242 distinct" in arithmetic.describe()
    same = load_task("basic_arithmetic", ONE_DIGIT, eval_size=100, seed=0)
    other = load_task("basic_arithmetic", ONE_DIGIT, eval_size=100, seed=1)
    assert [p.question for p in same.eval] == [p.question for p in arithmetic.eval]
    assert {p.question for p in other.eval} != eval_q


def test_split_that_does_not_fit_raises_with_sizes():
    with pytest.raises(ValueError, match=r"only 242 distinct questions.*eval_size=242"):
        load_task("basic_arithmetic", ONE_DIGIT, eval_size=242)
    prompts = [Prompt(str(i), f"q{i % 3}", "1") for i in range(10)]
    train, heldout = split_heldout(prompts, 1, train_size=2)
    assert (
        len(train) == 2 and len(heldout) == 1 and {p.question for p in train + heldout} == {"q0", "q1", "q2"}
    )
    with pytest.raises(ValueError, match="train_size=3"):
        split_heldout(prompts, 1, train_size=3)


def test_batches_are_deterministic_and_walk_epochs(arithmetic):
    assert arithmetic.batch(3, 4) == arithmetic.batch(3, 4)
    assert arithmetic.batch(0, 4) != arithmetic.batch(1, 4)
    # 71 steps of 2 = 142 = one epoch: every training question exactly once
    first_epoch = [p.question for step in range(71) for p in arithmetic.batch(step, 2)]
    assert sorted(first_epoch) == sorted(p.question for p in arithmetic.train)
    second_epoch = [p.question for step in range(71, 142) for p in arithmetic.batch(step, 2)]
    assert sorted(second_epoch) == sorted(first_epoch) and second_epoch != first_epoch
    with pytest.raises(ValueError, match="prompts_per_step"):
        arithmetic.batch(0, 143)


def test_score_uses_the_reasoning_gym_scorer_on_the_last_number(arithmetic):
    prompts = arithmetic.eval[:6]
    completions = [
        f"The answer is {prompts[0].answer}.",
        prompts[1].answer,
        f"{prompts[2].answer} is wrong, it is {int(prompts[2].answer) + 1}",
        "I don't know",
        [{"role": "assistant", "content": f"= {prompts[4].answer}"}],  # TRL conversational form
        f"{int(prompts[5].answer) + 10}",
    ]
    rewards = arithmetic.score(prompts, completions)
    assert rewards[:5] == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert rewards[5] < 1.0
    assert arithmetic.correct(prompts, completions) == [True, True, False, False, True, False]
    assert arithmetic.accuracy(prompts, completions) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="one prompt per completion"):
        arithmetic.score(prompts, completions[:2])


def test_the_same_number_written_otherwise_scores_as_the_answer(arithmetic):
    """reasoning-gym's basic_arithmetic compares strings: "3.0" for "3" got a third of the reward, "03" half.
    In last_number mode a number equal to the answer is scored as the dataset writes it; others are not."""
    from fp4rl.tasks import as_written

    p = next(p for p in arithmetic.eval if p.answer not in ("0", "-0") and not p.answer.startswith("-"))
    a = p.answer
    same = [f"It is {a}.0", f"{a}.00", f"0{a}", f"The result: {a}.000 "]
    wrong = [f"{a}.5", f"{int(a) + 1}.0", f"-{a}"]
    assert arithmetic.dataset.score_answer(f"{a}.0", p.entry) < 1.0  # the dataset's own scorer, unaided
    assert arithmetic.score([p] * len(same), same) == [1.0] * len(same)
    assert all(r < 1.0 for r in arithmetic.score([p] * len(wrong), wrong))
    assert as_written("-0", "0") == "0" and as_written("2.50", "2.5") == "2.5"
    assert as_written("2.5", "3") == "2.5" and as_written(None, "3") is None
    assert as_written("1,000", "1000") == "1,000"  # not a Decimal (extract_answer drops commas): unchanged


@pytest.mark.parametrize(
    "name, kwargs, extract",
    [
        ("products", dict(min_digits=1, max_digits=1), "last_number"),
        ("gcd", dict(max_value=30), "last_number"),
        ("chain_sum", {}, "last_number"),
        ("letter_counting", {}, "last_number"),
        ("countdown", {}, "answer_tag"),
    ],
)
def test_other_reasoning_gym_tasks_score_their_oracle_answer(name, kwargs, extract):
    task = load_task(
        name,
        kwargs,
        eval_size=5,
        pool_size=40,
        seed=0,
        extract=extract,
        suffix="" if extract == "answer_tag" else "Answer with the number only.",
    )
    prompts = task.eval
    wrap = (lambda a: f"<answer>{a}</answer>") if extract == "answer_tag" else (lambda a: f"So it is {a}.")
    assert task.score(prompts, [wrap(p.answer) for p in prompts]) == [1.0] * 5
    assert max(task.score(prompts, ["nothing"] * 5)) < 1.0


def test_last_number_refuses_a_task_whose_answers_are_not_numbers():
    """countdown's answers are expressions: the last number of a perfect answer never matches one."""
    with pytest.raises(ValueError, match=r"last_number.*countdown answers are not plain numbers.*answer_tag"):
        load_task("countdown", {}, eval_size=5, pool_size=40)


def test_reasoning_gym_errors_name_the_key():
    with pytest.raises(ValueError, match=r"not a reasoning-gym dataset.*'basic_arithmetic'"):
        load_task("basic_arithmetc")
    with pytest.raises(ValueError, match=r"task.kwargs for basic_arithmetic.*allowed keys:.*max_digits"):
        load_task("basic_arithmetic", {"digits": 2})
    with pytest.raises(ValueError, match="task.extract"):
        load_task("basic_arithmetic", ONE_DIGIT, extract="first")


def test_task_from_config():
    cfg = TaskConfig(kwargs=dict(ONE_DIGIT), eval_size=10, pool_size=500, seed=3)
    task = task_from_config(cfg)
    assert task.name == "basic_arithmetic" and task.sizes["eval"] == 10 and task.seed == 3
    assert set(EXTRACT_MODES) == {"last_number", "answer_tag", "last_line", "full"}


def test_jsonl_task_with_math_verify(tmp_path):
    path = tmp_path / "math.jsonl"
    rows = [{"prompt": f"Problem {i}", "answer": "1/2" if i % 2 else str(i)} for i in range(6)]
    rows[0]["id"] = "first"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    task = load_task("jsonl", {"path": str(path)}, eval_size=2, seed=0, suffix="")
    assert task.sizes == {"drawn": 6, "distinct": 6, "train": 4, "eval": 2}
    assert "first" in {p.id for p in task.train + task.eval}
    by_answer = {p.answer: p for p in task.train + task.eval}
    prompts = [by_answer["1/2"], by_answer["1/2"], by_answer["4"]]
    rewards = task.score(prompts, ["so $\\frac{1}{2}$", "it is 0.3", "\\boxed{4}"])
    assert rewards == [1.0, 0.0, 1.0]


def test_jsonl_custom_reward_and_errors(tmp_path):
    path = tmp_path / "nums.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"p{i}", "answer": f"{i},000"}) for i in range(4)))
    task = JsonlTask(path, reward="fp4rl.tasks:number_reward", eval_size=1)
    p = task.train[0]
    assert task.score([p, p], [f"= {p.answer}", "= 7"]) == [1.0, 0.0]
    seen = {}

    def reward(prompts, completions, answer, **kw):
        seen.update(kw, prompts=prompts)
        return [0.25] * len(completions)

    task = JsonlTask(path, reward=reward, eval_size=1)
    assert task.score(task.train[:2], ["a", "b"], step=3) == [0.25, 0.25]
    assert seen["step"] == 3 and seen["prompts"] == [q.question for q in task.train[:2]]
    with pytest.raises(ValueError, match="module:function"):
        load_reward("fp4rl.tasks.number_reward")
    with pytest.raises(ValueError, match="cannot be loaded"):
        load_reward("fp4rl.tasks:no_such_reward")
    with pytest.raises(ValueError, match="kwargs.path"):
        load_task("jsonl", {})
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: missing field\(s\) \['answer'\]"):
        JsonlTask(tmp_path / "bad.jsonl", eval_size=0)
    # one id for two questions: the loop would send the first question's tokens for both
    rows = [{"id": "1", "prompt": "What is 1/2 + 1/4?", "answer": "3/4"},
            {"id": "2", "prompt": "3+3?", "answer": "6"},
            {"id": "1", "prompt": "What is 2+2?", "answer": "4"}]
    (tmp_path / "dup.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(ValueError, match=r"prompt id '1' names two different questions.*ids must be unique"):
        JsonlTask(tmp_path / "dup.jsonl", eval_size=1)
    rows[2]["prompt"] = rows[0]["prompt"]  # the same question twice under one id: deduped, fine
    (tmp_path / "dup.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert JsonlTask(tmp_path / "dup.jsonl", eval_size=1).sizes["distinct"] == 2



def _jsonl(tmp_path, *lines, name="t.jsonl"):
    """A JSONL file of two good questions, then `lines` (raw text) from line 3 on."""
    good = [json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(2)]
    path = tmp_path / name
    path.write_text("\n".join(good + list(lines)) + "\n")
    return path


@pytest.mark.parametrize("line", ["5", "null", '"text"', '[{"prompt": "x", "answer": "1"}]'])
def test_jsonl_line_that_is_not_an_object_names_the_line(tmp_path, line):
    with pytest.raises(ValueError, match=r"t\.jsonl:3: a line must be a JSON object"):
        JsonlTask(_jsonl(tmp_path, line), eval_size=1)


@pytest.mark.parametrize("prompt", [0, None, ["q"], "", "  \n "])
def test_jsonl_prompt_must_be_a_non_empty_string(tmp_path, prompt):
    path = _jsonl(tmp_path, json.dumps({"prompt": prompt, "answer": "1"}))
    with pytest.raises(ValueError, match=r't\.jsonl:3: "prompt" must be a non-empty string'):
        JsonlTask(path, eval_size=1)


@pytest.mark.parametrize("path", [3, None, "", ["a.jsonl"]])
def test_jsonl_path_must_be_a_string(path):
    with pytest.raises(ValueError, match=r"task\.kwargs\.path = .*must be the JSONL file's path"):
        load_task("jsonl", {"path": path}, eval_size=1)


@pytest.mark.parametrize(
    "answer, problem",
    [(None, "must be a string or a number"), (["1", "one"], "must be a string or a number"),
     ({"x": 1}, "must be a string or a number"), (True, "must be a string or a number"),
     ("", "is empty"), (" ", "is empty"), (float("nan"), "is nan, not a finite number")],
)
def test_jsonl_answer_null_or_not_scalar_is_refused(tmp_path, answer, problem):
    """The reward gets str(answer): null was scored against the text "None", a list against "['1', 'one']"."""
    path = _jsonl(tmp_path, json.dumps({"prompt": "q9", "answer": answer}))
    with pytest.raises(ValueError, match=rf't\.jsonl:3: "answer" {problem}'):
        JsonlTask(path, eval_size=1)
    # numbers are fine: the reward gets them as text
    path = _jsonl(tmp_path, json.dumps({"prompt": "q9", "answer": 9.5}), name="ok.jsonl")
    task = JsonlTask(path, eval_size=1)
    assert {p.answer for p in task.train + task.eval} == {"0", "1", "9.5"}
    if problem == "is empty" or answer is None:  # a reward of one's own may not use the answer: "" / null
        path = _jsonl(tmp_path, json.dumps({"prompt": "q9", "answer": answer}), name="own.jsonl")
        task = JsonlTask(path, eval_size=1,
                         reward=lambda prompts, completions, answer, **kw: [0.0] * len(prompts))
        assert (answer or "") in {p.answer for p in task.train + task.eval}


@pytest.mark.parametrize("pid", [None, True, "", {"a": 1}])
def test_jsonl_bad_id_is_refused(tmp_path, pid):
    path = _jsonl(tmp_path, json.dumps({"id": pid, "prompt": "q9", "answer": "9"}))
    with pytest.raises(ValueError, match=r't\.jsonl:3: "id" must be a non-empty string or an integer'):
        JsonlTask(path, eval_size=1)


def test_jsonl_not_utf8_or_empty_names_the_file(tmp_path):
    path = tmp_path / "latin1.jsonl"
    text = '{"prompt": "q0", "answer": "0"}\n{"prompt": "caf\u00e9?", "answer": "1"}\n'
    path.write_bytes(text.encode("latin1"))
    with pytest.raises(ValueError, match=r"latin1\.jsonl:2: not UTF-8.*save the file as UTF-8"):
        JsonlTask(path, eval_size=1)
    bom = tmp_path / "bom.jsonl"  # a UTF-8 byte-order mark is fine
    bom.write_bytes(b"\xef\xbb\xbf" + _jsonl(tmp_path).read_bytes())
    assert JsonlTask(bom, eval_size=1).sizes["drawn"] == 2
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(ValueError, match=r"empty\.jsonl: no questions"):
        JsonlTask(tmp_path / "empty.jsonl", eval_size=1)


def test_jsonl_reward_spec_must_be_a_string():
    with pytest.raises(ValueError, match=r"task\.kwargs\.reward = 3: must be a 'package\.module:function'"):
        load_task("jsonl", {"path": "x.jsonl", "reward": 3}, eval_size=1)


@pytest.mark.parametrize(
    "returned, problem",
    [
        (None, r"returned NoneType None, not a list of rewards"),
        (0.5, r"returned float 0\.5, not a list of rewards"),
        ([1.0], r"returned 1 rewards for 2 completions"),
        ([1.0, 0.0, 1.0], r"returned 3 rewards for 2 completions"),
        ([1.0, None], r"returned a NoneType \(None\) at index 1, not a number"),
        (["1.0", 0.0], r"returned a str \('1\.0'\) at index 0, not a number"),
        ([0.0, float("nan")], r"returned nan at index 1 \(the first non-finite reward\)"),
        ([float("-inf"), float("inf")], r"returned -inf at index 0 \(the first non-finite reward\)"),
    ],
)
def test_custom_reward_that_returns_garbage_is_named(tmp_path, monkeypatch, returned, problem):
    (tmp_path / "my_rewards.py").write_text(
        "from math import inf, nan\n\n\n"
        f"def bad(prompts, completions, answer, **kw):\n    return {returned!r}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)  # each case imports its own
    task = load_task("jsonl", {"path": str(_jsonl(tmp_path)), "reward": "my_rewards:bad"}, eval_size=1)
    with pytest.raises(ValueError, match=rf"task\.kwargs\.reward = 'my_rewards:bad' {problem}.*"
                                         r"must return a list of 2 finite floats, one per completion"):
        task.score([task.train[0]] * 2, ["a", "b"])


def test_custom_reward_arrays_and_bools_are_accepted(tmp_path):
    np = pytest.importorskip("numpy")
    task = JsonlTask(_jsonl(tmp_path), reward=lambda prompts, completions, answer, **kw: np.array([1, 0.5]),
                     eval_size=1)
    assert task.score([task.train[0]] * 2, ["a", "b"]) == [1.0, 0.5]
    task.reward_fn = lambda prompts, completions, answer, **kw: (c == "a" for c in completions)
    assert task.score([task.train[0]] * 2, ["a", "b"]) == [1.0, 0.0]


def test_grpo_nan_reward_message_says_where_and_what_to_fix():
    import torch

    from fp4rl.grpo import group_advantages

    with pytest.raises(ValueError, match=r"NaN or Inf \(first: inf for group 1, completion 0\).*\.reward"):
        group_advantages(torch.tensor([[0.0, 1.0], [float("inf"), 0.0]]))

def test_rewards_directly():
    assert math_reward(["q"] * 2, ["$x = \\frac{3}{4}$", "0.7"], ["0.75", "0.75"]) == [1.0, 0.0]
    assert number_reward(["q"] * 3, ["12.0", "x", "-3"], ["12", "1", "-3"]) == [1.0, 0.0, 1.0]


def _fake_tokenizer(chat_template):
    words = [
        "<unk>",
        "<|im_start|>",
        "<|im_end|>",
        "user",
        "assistant",
        "system",
        "Be",
        "brief",
        "Calculate",
        "1",
        "+",
        "2",
        ".",
    ]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", additional_special_tokens=["<|im_start|>", "<|im_end|>"]
    )
    t.chat_template = chat_template
    return t


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chat_template_text_and_ids():
    tok = _fake_tokenizer(CHATML)
    text = apply_chat_template(tok, "Calculate 1 + 2 .")
    assert text == "<|im_start|>user\nCalculate 1 + 2 .<|im_end|>\n<|im_start|>assistant\n"
    ids = apply_chat_template(tok, "Calculate 1 + 2 .", system="Be brief", tokenize=True)
    assert ids == [1, 5, 6, 7, 2, 1, 3, 8, 9, 10, 11, 12, 2, 1, 4]


def test_chat_template_fallback_is_loud():
    tok = _fake_tokenizer(None)
    with pytest.warns(UserWarning, match="no chat template"):
        assert apply_chat_template(tok, "Calculate 1", system="Be brief") == "Be brief\n\nCalculate 1"
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(tok, "Calculate 1", fallback=False)
