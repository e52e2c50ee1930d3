"""Tasks on real reasoning-gym data, JSONL tasks, rewards and the chat template."""

import json

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
