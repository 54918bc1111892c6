"""The canary's answers against the baseline's: a fixed prompt set at temperature 0 and a fixed
seed, sent through the engine's OpenAI-compatible API.

The set: identifier-echo prompts (identifiers.py; 3,000 identifiers by default, several per
prompt) and a few long generations. It is sent in --rounds rounds (2 by default), each to both
servers at once (the same load on both while the metrics are read): the baseline's runs measure
its own run-to-run difference (batch composition changes low bits of its kernels, so a server at
temperature 0 need not answer alike twice; --enable-deterministic-inference makes it). Every run
of the canary is judged, since the hazard is intermittent and lands in any run: it fails where it
answers a prompt differently from the baseline and every baseline run agreed on it (the first
differing token is named), and where an identifier came back with more edits than any baseline
run made of it. Where the baseline differs from itself on more than --noise-max of the prompts
or identifiers, or nothing could be compared, the answers are INCONCLUSIVE: never a pass.

Answers are compared by token ids where every answer carries them (sglang 0.5.17+ returns them
with `return_token_ids`: `token_ids`, or `response_token_ids` on the chat API from 0.5.18),
else by characters; the verdict says which."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Callable, Optional

from . import fetch, identifiers
from .verdict import FAIL, INCONCLUSIVE, NOTE, OK, Finding, plural

LONG_PROMPTS = (
    "Explain in detail, step by step, how a hash table resolves collisions with open addressing and with separate "
    "chaining, and compare their behaviour as the load factor grows.",
    "Write a Python module that implements a least-recently-used cache with a fixed capacity, with docstrings, type "
    "hints and a few unit tests.",
    "List the first fifty prime numbers, one per line, and after each say whether it is a twin prime.",
    "Describe the water cycle to a curious ten-year-old, then describe it again for a university hydrology course.",
    "Translate this into French, German and Spanish, then explain every difference in word order: The quick brown fox "
    "jumps over the lazy dog while the farmer counts 37 sheep in the northern field.",
    "Derive the formula for the sum of the first n squares, then check it for n = 1 to 10 in a table.",
)
TOKENS_PER_IDENTIFIER = 32  # its number, the identifier and a line break, with room to spare: a cut answer is edits
SHOWN = 10  # differing prompts and edited identifiers said one per line; the JSON has all


@dataclasses.dataclass(frozen=True)
class Prompt:
    key: str
    kind: str  # "identifiers" or "long"
    text: str
    max_tokens: int
    identifiers: tuple = ()


def prompt_set(identifier_count: int, per_prompt: int, long_prompts: int, long_tokens: int, seed: int) -> list:
    made = identifiers.make(identifier_count, seed)
    groups = [made[i:i + per_prompt] for i in range(0, len(made), per_prompt)]
    width = len(str(len(groups)))
    prompts = [Prompt(f"identifiers-{n:0{width}d}", "identifiers", identifiers.prompt(group),
                      TOKENS_PER_IDENTIFIER * len(group) + 16, tuple(group)) for n, group in enumerate(groups, 1)]
    prompts += [Prompt(f"long-{n}", "long", text, long_tokens) for n, text in enumerate(LONG_PROMPTS[:long_prompts], 1)]
    return prompts


@dataclasses.dataclass(frozen=True)
class Answer:
    text: str = ""  # the answer (a chat answer's content)
    reasoning: str = ""  # a chat answer's reasoning_content, where the server separates it
    token_ids: Optional[tuple] = None  # every generated token, where the server returns them
    error: Optional[str] = None  # no answer: why

    @property
    def whole(self) -> str:
        return self.reasoning + self.text


class Client:
    """One server's OpenAI-compatible API, asked at temperature 0 with a fixed seed."""

    def __init__(self, name: str, url: str, api: str, model: str, extra: dict, seed: int, timeout: float):
        self.name, self.url, self.api, self.model = name, url, api, model
        self.extra, self.seed, self.timeout = extra, seed, timeout

    def body(self, prompt: Prompt) -> dict:
        # the chat API's max_tokens is deprecated for max_completion_tokens (every release 0.5.16 - 0.5.23 has it)
        asked = ({"messages": [{"role": "user", "content": prompt.text}], "max_completion_tokens": prompt.max_tokens}
                 if self.api == "chat" else {"prompt": prompt.text, "max_tokens": prompt.max_tokens})
        return {"model": self.model, **asked, "temperature": 0, "seed": self.seed, "return_token_ids": True,
                "stream": False, **self.extra}

    def ask(self, prompt: Prompt) -> Answer:
        path = "/v1/chat/completions" if self.api == "chat" else "/v1/completions"
        try:
            reply = fetch.post_json(self.url + path, self.body(prompt), self.timeout)
            choice = reply["choices"][0]
        except (fetch.Unreachable, fetch.HTTPFailure) as exc:
            return Answer(error=str(exc))
        except (KeyError, IndexError, TypeError):
            return Answer(error=f"no choices in the answer: {str(reply)[:fetch.BODY_EXCERPT]}")
        ids = choice.get("token_ids") or choice.get("response_token_ids")
        if self.api == "chat":
            message = choice.get("message") or {}
            text, reasoning = message.get("content") or "", message.get("reasoning_content") or ""
        else:
            text, reasoning = choice.get("text") or "", ""
        return Answer(text, reasoning, None if ids is None else tuple(ids))


def run_rounds(clients: dict, prompts: list, rounds: int, concurrency: int, say: Callable[[str], None]) -> dict:
    """name -> [run 1, run 2, ...], each run prompt key -> Answer; each round asks every
    server the whole set at once, `concurrency` requests in flight per server."""
    runs = {name: [] for name in clients}
    total = len(prompts) * len(clients)
    with concurrent.futures.ThreadPoolExecutor(max_workers=concurrency * len(clients)) as pool:
        for round_number in range(1, rounds + 1):
            asked = {pool.submit(client.ask, prompt): (name, prompt.key)
                     for prompt in prompts for name, client in clients.items()}
            answers = {name: {} for name in clients}
            step = max(1, total // 10)
            for done, future in enumerate(concurrent.futures.as_completed(asked), 1):
                name, key = asked[future]
                answers[name][key] = future.result()
                if done % step == 0 or done == total:
                    say(f"outputs: round {round_number} of {rounds}: {done}/{total} answers")
            for name in clients:
                runs[name].append(answers[name])
    return runs


# --- the comparison ----------------------------------------------------------------------------------

def excerpt(text: str, at: int) -> str:
    return text[max(0, at - 20):at + 40]


def first_difference(baseline: Answer, canary: Answer, by_tokens: bool) -> dict:
    a, b = baseline.whole, canary.whole
    char = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    found = {"token": None, "baseline_token": None, "canary_token": None, "char": char,
             "baseline_text": excerpt(a, char), "canary_text": excerpt(b, char)}
    if by_tokens:
        ids_a, ids_b = baseline.token_ids, canary.token_ids
        token = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
        found.update(token=token, baseline_token=ids_a[token] if token < len(ids_a) else None,
                     canary_token=ids_b[token] if token < len(ids_b) else None)
    return found


def said(difference: dict) -> str:
    if difference["token"] is not None:
        where = (f"at token {difference['token']} (baseline {_token(difference['baseline_token'])}, canary "
                 f"{_token(difference['canary_token'])})")
    else:
        where = f"at character {difference['char']}"
    return f"{where}: baseline {difference['baseline_text']!r}, canary {difference['canary_text']!r}"


def _token(token_id) -> str:
    return "end" if token_id is None else f"id {token_id}"


def listed(keys: list) -> str:
    return ", ".join(keys[:SHOWN]) + (f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else "")


def share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f} %" if whole else "-"


def compare(prompts: list, baseline_runs: list, canary_runs: list, noise_max: float) -> tuple:
    """(findings, the JSON's `outputs` body): every run of the canary against the baseline's, on
    the prompts every run of the baseline answers alike (token ids, else characters), and every
    identifier of every run against the most edits any baseline run made of it. Too little
    compared (the baseline unlike itself on more than `noise_max` of the prompts or identifiers,
    nothing answered) is INCONCLUSIVE, never a pass."""
    runs = len(canary_runs)
    errors = [{"server": name, "prompt": p.key, "run": n, "error": run[p.key].error}
              for name, all_runs in (("baseline", baseline_runs), ("canary", canary_runs))
              for n, run in enumerate(all_runs, 1) for p in prompts if run[p.key].error]
    failed_keys = {e["prompt"] for e in errors}
    judged = [p for p in prompts if p.key not in failed_keys]
    answers = [run[p.key] for all_runs in (baseline_runs, canary_runs) for run in all_runs for p in judged]
    by_tokens = bool(answers) and all(a.token_ids is not None for a in answers)
    same = (lambda x, y: x.token_ids == y.token_ids) if by_tokens else (lambda x, y: x.whole == y.whole)
    base = baseline_runs[0]
    noise = [p.key for p in judged if any(not same(base[p.key], other[p.key]) for other in baseline_runs[1:])]
    canary_noise = [p.key for p in judged
                    if any(not same(canary_runs[0][p.key], other[p.key]) for other in canary_runs[1:])]
    compared = [p for p in judged if p.key not in noise]
    differing = [{"prompt": p.key, "kind": p.kind, "run": n,
                  "first_difference": first_difference(base[p.key], run[p.key], by_tokens)}
                 for n, run in enumerate(canary_runs, 1) for p in compared if not same(base[p.key], run[p.key])]
    length = (lambda a: len(a.token_ids)) if by_tokens else (lambda a: len(a.whole))
    basis = "token ids" if by_tokens else "characters (a server returned no token ids)"
    edits, edit_findings = identifier_edits([p for p in judged if p.kind == "identifiers"], baseline_runs,
                                            canary_runs, len(failed_keys & {p.key for p in prompts
                                                                            if p.kind == "identifiers"}))
    counts = {"runs": runs, "prompts": len(compared), "answers": len(compared) * runs,
              ("tokens" if by_tokens else "characters"): runs * sum(length(base[p.key]) for p in compared),
              "identifiers": edits["count"]}
    found = _error_findings(errors, len(prompts), len(baseline_runs))
    if judged:  # with none, the errors said everything
        found += _noise_findings(noise, canary_noise, len(judged), len(baseline_runs), runs, basis)
        found += _differing_findings(differing, counts, basis)
    found += edit_findings
    found += _inconclusive(counts, noise, len(judged), edits, noise_max, bool(errors))
    body = {"basis": "tokens" if by_tokens else "characters", "rounds": runs, "prompts": len(prompts),
            "judged_prompts": len(judged), "compared": counts, "errors": errors, "baseline_noise": noise,
            "canary_noise": canary_noise, "differing": differing, "identifiers": edits}
    return found, body


def compared_text(counts: dict) -> str:
    """What the answers' verdict rests on, for the verdict line."""
    size = f"{counts['tokens']} tokens" if "tokens" in counts else f"{counts.get('characters', 0)} characters"
    return (f"{counts['prompts']} prompts and {counts['identifiers']} identifiers in each of the canary's "
            f"{counts['runs']} runs, {size} in all")


def _error_findings(errors: list, total: int, rounds: int) -> list:
    found = []
    for name in ("canary", "baseline"):
        mine = [e for e in errors if e["server"] == name]
        if mine:
            first = mine[0]
            what = (f"{len(mine)} of {total * rounds} requests got no answer (first: {first['prompt']}, run "
                    f"{first['run']}: {first['error']}); those prompts are not compared")
            # the canary's own errors fail it; the baseline's only leave less compared
            found.append(Finding(name, "answers", FAIL if name == "canary" else INCONCLUSIVE,
                                 what + ("" if name == "canary" else ": check the baseline and run again")))
    return found


def _noise_findings(noise: list, canary_noise: list, judged: int, rounds: int, runs: int, basis: str) -> list:
    base = (Finding("baseline", "noise", OK, f"its {rounds} runs answer all {judged} prompts alike (by {basis})")
            if not noise else
            Finding("baseline", "noise", NOTE, f"its {rounds} runs differ on {len(noise)} of {judged} prompts (by "
                                               f"{basis}): {listed(noise)}; their tokens are not compared, their "
                                               "identifiers are (beyond the baseline's own edits)"))
    canary = (Finding("canary", "noise", NOTE, f"its own {runs} runs differ on {len(canary_noise)} of {judged} "
                                               f"prompts: {listed(canary_noise)} (each run is judged against the "
                                               "baseline)")
              if canary_noise else None)
    return [base] + ([canary] if canary else [])


def _differing_findings(differing: list, counts: dict, basis: str) -> list:
    found = [Finding("canary", "outputs", FAIL, f"{d['prompt']} (run {d['run']}) differs from the baseline "
                                                f"{said(d['first_difference'])}")
             for d in differing[:SHOWN]]
    if len(differing) > SHOWN:
        found.append(Finding("canary", "outputs", FAIL, f"and {len(differing) - SHOWN} more answers differ (the JSON "
                                                        "verdict lists every one)"))
    if not counts["prompts"]:
        return found  # nothing compared: said as INCONCLUSIVE
    runs = counts["runs"]
    prompts = len({d["prompt"] for d in differing})
    in_runs = len({d["run"] for d in differing})
    summary = (f"{prompts} of {counts['prompts']} prompts on which the baseline's runs agree are answered "
               f"differently in {in_runs} of the canary's {runs} runs (compared by {basis})" if differing else
               f"all {counts['prompts']} prompts on which the baseline's runs agree are answered as the baseline's in "
               f"each of the canary's {runs} runs (compared by {basis})")
    found.append(Finding("canary", "outputs", FAIL if differing else OK, summary))
    return found


def _inconclusive(counts: dict, noise: list, judged: int, edits: dict, noise_max: float, errors: bool) -> list:
    """Too little compared to judge, and what to change."""
    if not judged:
        return [] if errors else [Finding("canary", "compared", INCONCLUSIVE, "no answers to compare")]
    deterministic = ("start both servers with --enable-deterministic-inference where the release supports it for "
                     "the model, or raise --noise-max if this run-to-run difference is expected")
    found = []
    if len(noise) > noise_max * judged or not counts["prompts"]:
        found.append(Finding("canary", "compared", INCONCLUSIVE,
                             f"the baseline's runs differ on {len(noise)} of {judged} prompts ({share(len(noise), judged)}"
                             f", more than --noise-max {noise_max:g}): {counts['prompts']} prompts compared by tokens; "
                             + deterministic))
    between, count = edits["baseline_run_to_run"]["identifiers"], edits["count"]
    if count and between > noise_max * count:
        found.append(Finding("canary", "compared", INCONCLUSIVE,
                             f"the baseline's runs give back {between} of {count} identifiers differently "
                             f"({share(between, count)}, more than --noise-max {noise_max:g}): the canary's edits of "
                             f"those are hidden within the baseline's; {deterministic}"))
    return found


def identifier_edits(prompts: list, baseline_runs: list, canary_runs: list, unanswered_prompts: int) -> tuple:
    """(the JSON's `identifiers`, findings): each identifier's edits in each run; in each run of
    the canary, the edits of each identifier above the most that any baseline run made of it."""
    names = ([f"baseline_run_{n}" for n in range(1, len(baseline_runs) + 1)]
             + [f"canary_run_{n}" for n in range(1, len(canary_runs) + 1)])
    runs = dict(zip(names, [*baseline_runs, *canary_runs]))
    base_names, canary_names = names[:len(baseline_runs)], names[len(baseline_runs):]
    totals = dict.fromkeys(runs, 0)
    beyond_per_run = dict.fromkeys(canary_names, 0)
    between = {"identifiers": 0, "edits": 0}  # the baseline's runs against its first
    edited, count = [], 0
    for prompt in prompts:
        back = {run: identifiers.read_back(answers[prompt.key].text, len(prompt.identifiers))
                for run, answers in runs.items()}
        for n, asked in enumerate(prompt.identifiers):
            count += 1
            made = {run: identifiers.edits(asked, back[run][n]) for run in runs}
            for run in runs:
                totals[run] += made[run]
            first = back[base_names[0]][n]
            if any(back[run][n] != first for run in base_names[1:]):
                between["identifiers"] += 1
                between["edits"] += max(identifiers.edits(first or "", back[run][n] or "") for run in base_names[1:])
            allowed = max(made[run] for run in base_names)
            for run in canary_names:
                if made[run] > allowed:
                    beyond_per_run[run] += made[run] - allowed
                    edited.append({"identifier": asked, "prompt": prompt.key, "number": n + 1,
                                   "run": int(run.rsplit("_", 1)[1]), "baseline": first, "canary": back[run][n],
                                   "baseline_edits": allowed, "canary_edits": made[run]})
    beyond = sum(beyond_per_run.values())
    body = {"count": count, "edits": totals, "baseline_run_to_run": between, "beyond_baseline": beyond,
            "beyond_baseline_per_run": beyond_per_run, "edited": edited}
    if not count:
        # too little compared; the server that did not answer is said above (the canary's errors fail it)
        return body, ([Finding("canary", "identifiers", INCONCLUSIVE, f"no identifier was compared: all "
                                                                      f"{unanswered_prompts} identifier prompts got no "
                                                                      "answer")]
                      if unanswered_prompts else [])
    skipped = f"; {unanswered_prompts} identifier prompts got no answer and are not counted" if unanswered_prompts else ""
    canary_totals = ", ".join(f"{totals[run]}" for run in canary_names)
    base_totals = ", ".join(f"{totals[run]}" for run in base_names)
    summary = (f"{plural(beyond, 'edit')} beyond the baseline's over {plural(count, 'identifier')} in each of the "
               f"canary's {len(canary_names)} runs (the canary's runs: {canary_totals} edits; the baseline's: "
               f"{base_totals}; the baseline's runs differ on {plural(between['identifiers'], 'identifier')}){skipped}")
    found = [Finding("canary", "identifiers", FAIL,
                     f"identifier {e['identifier']!r} ({e['prompt']} #{e['number']}, run {e['run']}) came back "
                     f"{e['canary']!r} from the canary ({plural(e['canary_edits'], 'edit')}), {e['baseline']!r} from "
                     f"the baseline (at most {plural(e['baseline_edits'], 'edit')})") for e in edited[:SHOWN]]
    if len(edited) > SHOWN:
        found.append(Finding("canary", "identifiers", FAIL, f"and {len(edited) - SHOWN} more edited identifiers (the "
                                                            "JSON verdict lists every one)"))
    found.append(Finding("canary", "identifiers", FAIL if beyond else OK, summary))
    return body, found
