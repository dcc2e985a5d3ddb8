"""Rule-based scorers of the built-in tasks and of verl's common datasets, looked up by ``data_source``.

Scorers have verl's signature ``compute_score(data_source, solution_str,
ground_truth, extra_info=None) -> float | dict`` and are looked up by the
row's ``data_source`` (``get_scorer``). Besides the built-in tasks
(``spmdrl.builtin.tasks``) there are ``gsm8k`` (``#### answer``) and ``math``
(``\\boxed{answer}``) scorers, because verl users bring those datasets.

The built-in tasks are meant for a ~4.5M-parameter model. The string tasks give
partial credit that random text sometimes earns and that rises smoothly on the way
to the exact answer, so a randomly initialised policy can learn them. ``arith`` is
the main job's task, which starts from an SFT warm start that already answers with
a number: it pays for the right answer, as verl's gsm8k scorer does, so the
reward reads as accuracy.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Callable, Optional, Union

Score = Union[float, dict[str, Any]]
ScoreFn = Callable[..., Score]

# Special tokens of the built-in tokenizer (and of Qwen's): a loop that decodes
# with skip_special_tokens=False leaves them in the text, and "7<|im_end|>" must
# still count as the concise answer "7".
_SPECIAL_TEXT = re.compile(r"<\|(?:im_end|im_start|endoftext)\|>")
_INT = re.compile(r"-?\d+")


def _strip_special(text: str) -> str:
    return _SPECIAL_TEXT.sub("", text).strip()


# --------------------------------------------------------------------------- arith


def arith_score(data_source: str, solution_str: str, ground_truth: Any,
                extra_info: Optional[dict] = None) -> dict:
    """Reward in [0, 1] for a single-integer answer; 1.0 only for the bare correct answer.

    - no integer in the response: 0
    - otherwise conciseness * (0.1 + 0.9 * correct), with correct = the first integer is the answer and
      conciseness = min(1, len(answer) / len(response)): 1 when nothing else was said. 0.1 is the format
      credit (verl gsm8k's ``format_score``).

    So the reward of a policy that answers with a bare number is 0.1 + 0.9 x its accuracy, and the unique
    optimum is "<answer><EOS>". A wrong answer earns the format credit only, however near it is: a near-miss
    credit would pay sharpening onto a neighbouring digit and hide accuracy in the reward. The format credit
    shrinks with extra text too: otherwise text after a wrong digit costs nothing, GRPO's negative advantages
    on wrong answers push the end-of-turn token down, and responses drift longer (measured: length 2 -> 4.8
    and entropy 0.5 -> 3 within 20 steps, 180 steps into a run).
    """
    text, answer = _strip_special(solution_str), str(ground_truth).strip()
    m = _INT.search(text)
    if m is None:  # pred "" (no answer) still votes in validation's maj@k
        return {"score": 0.0, "acc": 0.0, "pred": ""}
    pred, ans = int(m.group()), int(answer)
    correct = pred == ans
    conciseness = min(1.0, len(answer) / len(text))
    return {"score": conciseness * (0.1 + 0.9 * float(correct)), "acc": float(correct), "pred": str(pred)}


# --------------------------------------------------------------------------- copy / reverse


def string_match_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None
) -> dict:
    """1.0 for the exact string, else 0.9 * difflib similarity (partial credit for shared characters)."""
    text, target = _strip_special(solution_str), str(ground_truth).strip()
    if text == target:
        return {"score": 1.0, "acc": 1.0, "pred": text}
    return {"score": 0.9 * difflib.SequenceMatcher(None, text, target).ratio(), "acc": 0.0, "pred": text}


# --------------------------------------------------------------------------- gsm8k


def _clean_number(s: str) -> str:
    return s.replace(",", "").replace("$", "").strip().rstrip(".")


def extract_gsm8k_answer(solution_str: str, method: str = "strict") -> Optional[str]:
    """The answer after the last ``####`` (strict), or the last number in the text (flexible)."""
    # Long generations only end with the answer; scanning the tail keeps a
    # pathological 100k-character response cheap.
    tail = solution_str[-300:]
    if method == "strict":
        found = re.findall(r"####\s*(-?[0-9.,$]+)", tail)
        return _clean_number(found[-1]) if found else None
    if method == "flexible":
        found = [f for f in re.findall(r"-?[0-9][0-9.,]*", tail) if _clean_number(f) not in ("", ".")]
        return _clean_number(found[-1]) if found else None
    raise ValueError(f"unknown gsm8k extraction method {method!r}; valid: strict, flexible")


def _same_number(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return abs(float(a) - float(b)) < 1e-9
    except ValueError:
        return False


def gsm8k_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Optional[dict] = None,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` when the ``#### answer`` equals the ground truth, ``format_score`` when it differs, 0 when
    absent."""
    pred = extract_gsm8k_answer(solution_str, method)
    if pred is None:
        return 0.0
    gt = _clean_number(str(ground_truth))
    # A ground truth copied from the GSM8K solution column still carries "#### x".
    if "####" in gt:
        gt = _clean_number(gt.split("####")[-1])
    return score if _same_number(pred, gt) else format_score


# --------------------------------------------------------------------------- math (\boxed{})


def last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, ``\\boxed x``) in ``text``, braces
    balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    if rest.startswith("\\boxed "):
        return rest[len("\\boxed ") :].split("$")[0].strip()
    open_at = rest.find("{")
    if open_at < 0:
        return None
    depth = 0
    for i in range(open_at, len(rest)):
        if rest[i] == "{":
            depth += 1
        elif rest[i] == "}":
            depth -= 1
            if depth == 0:
                return rest[open_at + 1 : i]
    return None


def _frac_to_slash(s: str) -> str:
    # \frac{a}{b} and the shorthand \frac12 both become a/b so that they compare equal.
    s = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
    s = re.sub(r"\\frac(\d)(\d)", r"(\1)/(\2)", s)
    s = re.sub(r"\(([A-Za-z0-9.]+)\)", r"\1", s)
    return s


def normalize_math_answer(answer: str) -> str:
    """A canonical string for a short LaTeX answer: spacing, \\left/\\right, units, degrees, fractions."""
    s = answer.strip()
    s = re.sub(r"\\text\{\s*([^{}]*)\}", r"\1", s)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\ ", ""),
                     ("dfrac", "frac"), ("tfrac", "frac"), ("^\\circ", ""), ("^{\\circ}", ""), ("\\$", ""),
                     ("$", ""), ("\\%", ""), ("%", "")):
        s = s.replace(old, new)
    s = s.replace(" ", "").rstrip(".")
    # "x = 5" answers the question "x"; the value is what is compared.
    if re.fullmatch(r"[A-Za-z]\w*=.+", s):
        s = s.split("=", 1)[1]
    if re.fullmatch(r"-?\d[\d,]*(\.\d+)?", s):
        s = s.replace(",", "")
    s = _frac_to_slash(s)
    if re.fullmatch(r"-?\d+\.\d*", s):
        s = s.rstrip("0").rstrip(".")
    if s.startswith("."):
        s = "0" + s
    return s


def math_score(data_source: str, solution_str: str, ground_truth: Any,
               extra_info: Optional[dict] = None) -> float:
    """1.0 when the last ``\\boxed{}`` answer equals the ground truth after normalisation, else 0."""
    pred = last_boxed(solution_str)
    if pred is None:
        return 0.0
    gt = str(ground_truth)
    gt = last_boxed(gt) or gt
    a, b = normalize_math_answer(pred), normalize_math_answer(gt)
    return 1.0 if a == b or _same_number(a, b) else 0.0


# --------------------------------------------------------------------------- calc (tools)


_ANSWER = re.compile(r"Answer:\s*(-?\d+)")


def calc_score(data_source: str, solution_str: str, ground_truth: Any,
               extra_info: Optional[dict] = None) -> dict:
    """1.0 when the last assistant turn says ``Answer: <the exact value>``; otherwise 0.2 for a calculator
    call that ran without error (credit for using the tool), 0.1 for an ``Answer: <integer>`` that is
    wrong, else 0.

    The answer is read from the last assistant message of ``extra_info["messages"]`` (multi-turn rollouts put
    the conversation there), else from the end of ``solution_str``, so tool output is never taken for it.
    """
    info = extra_info or {}
    assistant = [m["content"] for m in info.get("messages") or [] if m.get("role") == "assistant"]
    text = assistant[-1] if assistant else _strip_special(solution_str)
    found = _ANSWER.findall(text)
    correct = bool(found) and found[-1] == str(ground_truth).strip()
    used = any(not c.get("error") for c in info.get("tool_calls") or [])
    score = 1.0 if correct else 0.2 if used else 0.1 if found else 0.0
    return {"score": score, "acc": float(correct), "tool_used": float(used)}


# --------------------------------------------------------------------------- registries


# data_source -> scorer. The aliases are the names verl's datasets carry.
SCORERS: dict[str, ScoreFn] = {
    "spmdrl/arith": arith_score,
    "spmdrl/copy": string_match_score,
    "spmdrl/reverse": string_match_score,
    "spmdrl/calc": calc_score,
    "gsm8k": gsm8k_score,
    "openai/gsm8k": gsm8k_score,
    "math": math_score,
    "lighteval/MATH": math_score,
    "DigitalLearningGmbH/MATH-lighteval": math_score,
    "HuggingFaceH4/MATH-500": math_score,
}


def get_scorer(data_source: str) -> ScoreFn:
    """The built-in scorer for a row's ``data_source``; unknown sources list the known ones."""
    if data_source not in SCORERS:
        raise ValueError(
            f"no built-in scorer for data_source {data_source!r} (reward.function=builtin); "
            f"known data sources: {', '.join(sorted(SCORERS))}; "
            "or set reward.function to path/to/file.py:function"
        )
    return SCORERS[data_source]


def compute_score(data_source: str, solution_str: str, ground_truth: Any,
                  extra_info: Optional[dict] = None) -> Score:
    """verl-style default: dispatch on ``data_source`` to the built-in scorer."""
    return get_scorer(data_source)(data_source, solution_str, ground_truth, extra_info)
