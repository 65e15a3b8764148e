"""Synthetic math tasks for training tiny tool-using agents: problems that a 1-3 line Python program solves exactly.

Each family ("mod_pow", "gcd", ...) has one fixed English template, an exact integer answer computed here in plain
Python, and a `solution_code` snippet that prints that answer, written the way a model should write it, plus
`other_solutions`: correct programs in other styles (a loop, a built-in, a closed form, sympy). SFT data written
with several styles gives a model a choice the reward does not care about, entropy that GRPO can collapse
(`make_sft_rows(styles="mixed")`). Difficulty 1 keeps the numbers small enough for a strong human to work by hand;
difficulty 3 clearly needs code.

Train and test never share a problem, whatever the seeds: a problem belongs to the test split when the SHA-256 of its
text falls in 2 of 10 buckets and to train otherwise (`split_of`), and `generate_tasks` keeps only candidates of the
split it was asked for.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
from collections.abc import Callable, Sequence
from typing import Any, Literal, get_args

from stare_agent import protocol
from stare_agent.data import Problem

Difficulty = Literal[1, 2, 3]
Split = Literal["train", "test"]

TEST_BUCKETS = frozenset({0, 1})
"""Buckets (of 10, from the SHA-256 of the problem text) whose problems are test-only."""
MAX_TRIES = 2000
"""Candidates rejected in a row (other split, or already drawn) before a family and difficulty count as exhausted."""

# One drawn problem: (text, answer, programs that print the answer, the usual one first). In each family the ranges
# are indexed by difficulty - 1. Every program ends with its print(...) line (the SFT typo episodes rely on it).
Draw = tuple[str, int, tuple[str, ...]]


def _mod_pow(rng: random.Random, level: int) -> Draw:
    a = rng.randint(*((2, 9), (2, 50), (10, 1000))[level - 1])
    b = rng.randint(*((10, 30), (50, 500), (1000, 10**6))[level - 1])
    m = rng.randint(*((3, 20), (10, 100), (100, 10**4))[level - 1])
    codes = (
        f"print(pow({a}, {b}, {m}))",
        f"print({a}**{b} % {m})",
        f"r = 1\nfor _ in range({b}):\n    r = r * {a} % {m}\nprint(r)",
    )
    return f"What is the remainder when {a}^{b} is divided by {m}?", pow(a, b, m), codes


def _digit_sum_pow(rng: random.Random, level: int) -> Draw:
    lo, hi = ((2, 15), (2, 30), (2, 100))[level - 1]
    a = rng.choice([k for k in range(lo, hi + 1) if k % 10])  # powers of 10 are trivial
    b = rng.randint(*((2, 9), (10, 40), (50, 300))[level - 1])
    value, total = a**b, 0
    while value:
        value, digit = divmod(value, 10)
        total += digit
    codes = (
        f"print(sum(int(d) for d in str({a}**{b})))",
        f"print(sum(map(int, str({a}**{b}))))",
        f"n, s = {a}**{b}, 0\nwhile n:\n    n, d = divmod(n, 10)\n    s += d\nprint(s)",
    )
    return f"What is the sum of the digits of {a}^{b}?", total, codes


def _count_divisible(rng: random.Random, level: int) -> Draw:
    n = rng.randint(*((30, 100), (100, 2000), (10**4, 10**5))[level - 1])
    lo, hi = ((2, 6), (3, 15), (7, 60))[level - 1]
    a, b = sorted(rng.sample(range(lo, hi + 1), 2))
    answer = n // a + n // b - n // math.lcm(a, b)  # inclusion-exclusion
    text = f"How many integers from 1 to {n} are divisible by {a} or by {b}?"
    codes = (
        f"print(sum(1 for k in range(1, {n + 1}) if k % {a} == 0 or k % {b} == 0))",
        f"print(len([k for k in range(1, {n + 1}) if k % {a} == 0 or k % {b} == 0]))",
        f"import math\nprint({n} // {a} + {n} // {b} - {n} // math.lcm({a}, {b}))",
    )
    return text, answer, codes


def _num_divisors(rng: random.Random, level: int) -> Draw:
    n = rng.randint(*((12, 200), (200, 10**4), (10**5, 10**6))[level - 1])
    answer = sum(1 if q * q == n else 2 for q in range(1, math.isqrt(n) + 1) if n % q == 0)
    return (
        f"How many positive divisors does {n} have?",
        answer,
        (
            f"print(sum(1 for d in range(1, {n + 1}) if {n} % d == 0))",
            f"print(len([d for d in range(1, {n + 1}) if {n} % d == 0]))",
            f"import sympy\nprint(sympy.divisor_count({n}))",
        ),
    )


def _gcd(rng: random.Random, level: int) -> Draw:
    # A shared factor g, so that the answer is rarely 1.
    lo, hi = ((2, 12), (10, 200), (100, 10**5))[level - 1]
    g = rng.randint(lo, hi)
    a, b = (g * x for x in sorted(rng.sample(range(lo, hi + 1), 2)))
    return (
        f"What is the greatest common divisor of {a} and {b}?",
        math.gcd(a, b),
        (
            f"import math\nprint(math.gcd({a}, {b}))",
            f"a, b = {a}, {b}\nwhile b:\n    a, b = b, a % b\nprint(a)",
            f"import sympy\nprint(sympy.gcd({a}, {b}))",
        ),
    )


def _sum_squares_mod(rng: random.Random, level: int) -> Draw:
    n = rng.randint(*((5, 15), (20, 300), (1000, 10**5))[level - 1])
    m = rng.randint(*((7, 50), (50, 1000), (1000, 10**5))[level - 1])
    answer = n * (n + 1) * (2 * n + 1) // 6 % m
    text = f"What is the remainder when 1^2 + 2^2 + ... + {n}^2 is divided by {m}?"
    codes = (
        f"print(sum(k * k for k in range(1, {n + 1})) % {m})",
        f"print({n} * ({n} + 1) * (2 * {n} + 1) // 6 % {m})",
        f"total = 0\nfor k in range(1, {n + 1}):\n    total += k**2\nprint(total % {m})",
    )
    return text, answer, codes


def _fib(n: int, m: int) -> tuple[int, int]:
    """(F(n) mod m, F(n+1) mod m) by fast doubling: a different route from the loop in the solution code."""
    if n == 0:
        return 0, 1 % m
    a, b = _fib(n // 2, m)
    even = a * (2 * b - a) % m  # F(2k)
    odd = (a * a + b * b) % m  # F(2k+1)
    return (odd, (even + odd) % m) if n % 2 else (even, odd)


def _fib_mod(rng: random.Random, level: int) -> Draw:
    n = rng.randint(*((10, 25), (30, 300), (1000, 10**5))[level - 1])
    m = rng.randint(*((5, 30), (10, 1000), (1000, 10**5))[level - 1])
    text = (
        "The Fibonacci numbers are F(1) = 1, F(2) = 1 and F(k) = F(k-1) + F(k-2). "
        f"What is the remainder when F({n}) is divided by {m}?"
    )
    codes = (
        f"a, b = 0, 1\nfor _ in range({n}):\n    a, b = b, (a + b) % {m}\nprint(a)",
        f"f = [0, 1]\nfor _ in range({n - 1}):\n    f.append((f[-1] + f[-2]) % {m})\nprint(f[{n}])",
        f"import sympy\nprint(sympy.fibonacci({n}) % {m})",
    )
    return text, _fib(n, m)[0], codes


def _count_primes(rng: random.Random, level: int) -> Draw:
    n = rng.randint(*((10, 200), (200, 5000), (10**4, 10**5))[level - 1])
    sieve = bytearray([0, 0]) + bytearray([1]) * (n - 1)  # sieve[k] = 1 iff k is prime, k = 0..n
    for p in range(2, math.isqrt(n) + 1):
        if sieve[p]:
            sieve[p * p :: p] = bytes(len(range(p * p, n + 1, p)))
    codes = (
        f"import math\nprint(sum(1 for k in range(2, {n + 1}) if all(k % d for d in range(2, math.isqrt(k) + 1))))",
        f"import sympy\nprint(sympy.primepi({n}))",
        f"s = [True] * {n + 1}\nfor p in range(2, {n + 1}):\n    for q in range(p * p, {n + 1}, p):\n"
        f"        s[q] = False\nprint(sum(s[2:]))",
    )
    return f"How many prime numbers are less than or equal to {n}?", sum(sieve), codes


_FAMILIES: dict[str, Callable[[random.Random, int], Draw]] = {
    "mod_pow": _mod_pow,
    "digit_sum_pow": _digit_sum_pow,
    "count_divisible": _count_divisible,
    "num_divisors": _num_divisors,
    "gcd": _gcd,
    "sum_squares_mod": _sum_squares_mod,
    "fib_mod": _fib_mod,
    "count_primes": _count_primes,
}
FAMILIES: tuple[str, ...] = tuple(_FAMILIES)


def split_of(text: str) -> Split:
    """The only split this problem text may ever appear in."""
    bucket = int(hashlib.sha256(text.encode("utf-8")).hexdigest(), 16) % 10
    return "test" if bucket in TEST_BUCKETS else "train"


def generate_tasks(
    n: int,
    *,
    seed: int = 0,
    split: Split = "train",
    difficulty: int | Sequence[int] = (1, 2, 3),
    families: Sequence[str] | None = None,
) -> list[Problem]:
    """n distinct problems of `split`, the same list for the same arguments.

    Families and difficulties are mixed by a diagonal walk over the F x D grid of (family, difficulty), stepping
    along its longer side: the first max(F, D) problems hold every family and every difficulty, the first F * D
    problems every pair.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0; got {n}")
    if split not in get_args(Split):
        raise ValueError(f"split must be one of {', '.join(get_args(Split))}; got {split!r}")
    levels = [difficulty] if isinstance(difficulty, int) else list(difficulty)
    if not levels or any(level not in get_args(Difficulty) for level in levels):
        raise ValueError(f"difficulty must be one of 1, 2, 3 (or a non-empty sequence of them); got {difficulty!r}")
    names = [families] if isinstance(families, str) else list(FAMILIES if families is None else families)
    unknown = [name for name in names if name not in _FAMILIES]
    if not names or unknown:
        raise ValueError(f"families must be a non-empty selection of {', '.join(FAMILIES)}; got {families!r}")

    # A str seed is hashed with SHA-512 by `random`, so the stream is the same in every process.
    rng = random.Random(f"stare-tasks:{split}:{seed}")
    problems: list[Problem] = []
    seen: set[str] = set()
    long_side, short_side = max(len(names), len(levels)), min(len(names), len(levels))
    for i in range(n):
        step, lap = i % long_side, (i % long_side + i // long_side) % short_side
        name, level = (names[step], levels[lap]) if len(names) >= len(levels) else (names[lap], levels[step])
        for _ in range(MAX_TRIES):
            text, answer, codes = _FAMILIES[name](rng, level)
            problem_id = f"synthetic-{split}-{name}-{hashlib.sha256(text.encode('utf-8')).hexdigest()[:8]}"
            if split_of(text) == split and problem_id not in seen:
                break
        else:
            raise ValueError(
                f"could not draw a new {split} problem of family {name!r} at difficulty {level} after {MAX_TRIES} "
                f"tries ({len(problems)} drawn so far): ask for fewer problems or allow more difficulties"
            )
        seen.add(problem_id)
        meta = {
            "family": name,
            "difficulty": level,
            "split": split,
            "solution_code": codes[0],
            "other_solutions": list(codes[1:]),
        }
        problems.append(Problem(id=problem_id, problem=text, answer=str(answer), source="synthetic", meta=meta))
    return problems


# --- tool-use transcripts (SFT) -----------------------------------------------------------------------------------

_INTROS = (
    "This needs exact arithmetic, so I will let Python compute it.",
    "Doing this by hand is error-prone; a short program gives the exact value.",
    "I will write a small program to compute this exactly.",
    "Let me compute it with Python.",
)
_TYPO_FIX = "The last line has a typo in the variable name. Here is the corrected program."


def _call(code: str) -> str:
    return f"{protocol.CODE_OPEN}\n```python\n{code}\n```\n{protocol.CODE_CLOSE}"


SolutionStyles = Literal["one", "mixed"]


async def _transcript(
    problem: Problem, client: Any, rng: random.Random, with_error: bool, max_chars: int, styles: SolutionStyles
) -> str:
    """The assistant text for one problem; each code block is run as a stateless sandbox call.

    Stateless calls reuse warm kernels (milliseconds each), where a session per transcript would start a
    kernel per transcript; the programs are self-contained, so they also suit the stateless tool mode.
    """
    code = problem.meta["solution_code"]
    if styles == "mixed":  # only then a draw: "one" keeps the transcripts it always made
        code = rng.choice([code, *problem.meta.get("other_solutions", [])])
    *body, last = code.splitlines()
    if not (last.startswith("print(") and last.endswith(")")):
        raise ValueError(f"{problem.id}: solution_code must end with a print(...) line; got {last!r}")
    calls, texts = [code], [rng.choice(_INTROS)]
    if with_error:  # first a typo the interpreter reports, then the corrected program
        value = last[len("print(") : -1]
        calls, texts = (
            [
                "\n".join([*body, f"result = {value}", "print(reslt)"]),
                "\n".join([*body, f"result = {value}", "print(result)"]),
            ],
            [texts[0], _TYPO_FIX],
        )
    parts, output = [], ""
    for text, call in zip(texts, calls, strict=True):
        result = await client.execute(call)
        if result.status == "sandbox_error":
            raise RuntimeError(f"{problem.id}: the sandbox failed: {result.error}")
        output = protocol.tool_output(result, max_chars)
        parts.append(f"{text}\n{_call(call)}{protocol.observation(output)}")
    if output != problem.answer:
        raise RuntimeError(f"{problem.id}: the solution printed {output!r}, expected {problem.answer!r}")
    return "".join(parts) + f"The program prints {output}.\n" + protocol.final_answer(output)


async def make_sft_rows(
    problems: Sequence[Problem],
    client: Any,
    *,
    seed: int = 0,
    error_fraction: float = 0.25,
    system_prompt: str | None = protocol.SYSTEM_PROMPT,
    output_max_chars: int = 1024,
    concurrency: int = 8,
    styles: SolutionStyles = "one",
) -> list[dict[str, Any]]:
    """ReTool-SFT rows (`messages`: [system], user, assistant) for synthetic problems, every code block really
    executed through `client` (a sandbox client), so each interpreter block is true output.

    A fraction of transcripts first make a typo, see the NameError, and run the corrected program in a
    second call. `styles`: "one" writes each family's usual program; "mixed" one of its programs (usual or
    other style), drawn uniformly per transcript. Rows come back in the order of `problems`.
    """
    if not 0.0 <= error_fraction <= 1.0:
        raise ValueError(f"error_fraction must be in [0, 1]; got {error_fraction}")
    if styles not in get_args(SolutionStyles):
        raise ValueError(f"styles must be one of {', '.join(get_args(SolutionStyles))}; got {styles!r}")
    rng = random.Random(f"stare-sft:{seed}")
    plans = [(problem, random.Random(rng.random()), rng.random() < error_fraction) for problem in problems]
    limit = asyncio.Semaphore(concurrency)

    async def row(problem: Problem, row_rng: random.Random, with_error: bool) -> dict[str, Any]:
        async with limit:
            text = await _transcript(problem, client, row_rng, with_error, output_max_chars, styles)
        messages = [*protocol.prompt_messages(problem.problem, system_prompt), {"role": "assistant", "content": text}]
        meta = {k: v for k, v in problem.meta.items() if k not in ("solution_code", "other_solutions")}
        return {
            "id": problem.id,
            "messages": messages,
            "answer": problem.answer,
            "source": problem.source,
            "meta": meta,
        }

    return list(await asyncio.gather(*(row(*plan) for plan in plans)))
