"""The canary's answers against the baseline's: a fixed prompt set at temperature 0 and a fixed
seed, sent through the engine's OpenAI-compatible API.

The set: identifier-echo prompts (identifiers.py; 3,000 identifiers by default, several per
prompt) and a few long generations. It is sent in two rounds, each to both servers at once (the
same load on both while the metrics are read): the baseline's two runs measure its own
run-to-run difference (batch composition changes low bits of its kernels, so a server at
temperature 0 need not answer alike twice; --enable-deterministic-inference makes it); the
canary's first run is judged against the baseline's, its second only said. The canary fails
where it answers a prompt differently from the baseline and the baseline's two runs agreed on
it (the first differing token is named), and where an identifier came back with more edits
from the canary than from either baseline run.

Answers are compared by token ids where every answer carries them (sglang 0.5.17+ returns them
with `return_token_ids`: `token_ids`, or `response_token_ids` on the chat API from 0.5.18),
else by characters; the verdict says which."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Callable, Optional

from . import fetch, identifiers
from .verdict import FAIL, NOTE, OK, Finding, plural

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


def compare(prompts: list, baseline_runs: list, canary_runs: list) -> tuple:
    """(findings, the JSON's `outputs` body) for the baseline's two runs and the canary's."""
    errors = [{"server": name, "prompt": p.key, "run": n, "error": run[p.key].error}
              for name, runs in (("baseline", baseline_runs), ("canary", canary_runs))
              for n, run in enumerate(runs, 1) for p in prompts if run[p.key].error]
    failed_keys = {e["prompt"] for e in errors}
    judged = [p for p in prompts if p.key not in failed_keys]
    answers = [run[p.key] for runs in (baseline_runs, canary_runs) for run in runs for p in judged]
    by_tokens = bool(answers) and all(a.token_ids is not None for a in answers)
    same = (lambda x, y: x.token_ids == y.token_ids) if by_tokens else (lambda x, y: x.whole == y.whole)
    (base_1, base_2), (canary_1, canary_2) = baseline_runs, canary_runs
    noise = [p.key for p in judged if not same(base_1[p.key], base_2[p.key])]
    canary_noise = [p.key for p in judged if not same(canary_1[p.key], canary_2[p.key])]
    differing = [{"prompt": p.key, "kind": p.kind, "first_difference": first_difference(base_1[p.key], canary_1[p.key],
                                                                                        by_tokens)}
                 for p in judged if p.key not in noise and not same(base_1[p.key], canary_1[p.key])]
    basis = "token ids" if by_tokens else "characters (a server returned no token ids)"
    found = _error_findings(errors, len(prompts))
    if judged:  # with none, the errors said everything
        found += _noise_findings(noise, canary_noise, len(judged), basis)
        found += _differing_findings(differing, len(judged) - len(noise), basis)
    edits, edit_findings = identifier_edits([p for p in judged if p.kind == "identifiers"], baseline_runs, canary_runs,
                                            len(failed_keys & {p.key for p in prompts if p.kind == "identifiers"}))
    found += edit_findings
    body = {"basis": "tokens" if by_tokens else "characters", "prompts": len(prompts), "judged_prompts": len(judged),
            "errors": errors, "baseline_noise": noise, "canary_noise": canary_noise, "differing": differing,
            "identifiers": edits}
    return found, body


def _error_findings(errors: list, total: int) -> list:
    found = []
    for name in ("baseline", "canary"):
        mine = [e for e in errors if e["server"] == name]
        if mine:
            first = mine[0]
            found.append(Finding(name, "answers", FAIL,
                                 f"{len(mine)} of {total * 2} requests got no answer (first: {first['prompt']}, run "
                                 f"{first['run']}: {first['error']}); those prompts are not compared"))
    return found


def _noise_findings(noise: list, canary_noise: list, judged: int, basis: str) -> list:
    def listed(keys):
        return ", ".join(keys[:SHOWN]) + (f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else "")

    base = (Finding("baseline", "noise", OK, f"its two runs answer all {judged} prompts alike (by {basis})")
            if not noise else
            Finding("baseline", "noise", NOTE, f"its two runs differ on {len(noise)} of {judged} prompts (by {basis}): "
                                               f"{listed(noise)}; the canary is not judged by tokens there"))
    canary = (Finding("canary", "noise", NOTE, f"its own two runs differ on {len(canary_noise)} of {judged} prompts: "
                                               f"{listed(canary_noise)} (said, not judged: its first run is compared)")
              if canary_noise else None)
    return [base] + ([canary] if canary else [])


def _differing_findings(differing: list, judged: int, basis: str) -> list:
    found = [Finding("canary", "outputs", FAIL, f"{d['prompt']} differs from the baseline {said(d['first_difference'])}")
             for d in differing[:SHOWN]]
    if len(differing) > SHOWN:
        found.append(Finding("canary", "outputs", FAIL, f"and {len(differing) - SHOWN} more prompts differ (the JSON "
                                                        "verdict lists every one)"))
    summary = (f"{len(differing)} of {judged} prompts on which the baseline's runs agree are answered differently "
               f"(compared by {basis})" if differing else
               f"all {judged} prompts on which the baseline's runs agree are answered as the baseline's (compared by "
               f"{basis})")
    found.append(Finding("canary", "outputs", FAIL if differing else OK, summary))
    return found


def identifier_edits(prompts: list, baseline_runs: list, canary_runs: list, unanswered_prompts: int) -> tuple:
    """(the JSON's `identifiers`, findings): each identifier's edits in each run; the canary's
    beyond the baseline's: for each identifier, its edits in the canary's first run above the
    larger of the baseline's two."""
    runs = {"baseline_run_1": baseline_runs[0], "baseline_run_2": baseline_runs[1],
            "canary_run_1": canary_runs[0], "canary_run_2": canary_runs[1]}
    totals = dict.fromkeys(runs, 0)
    between = {"identifiers": 0, "edits": 0}  # the baseline's run 1 against its run 2
    beyond, edited, count = 0, [], 0
    for prompt in prompts:
        back = {run: identifiers.read_back(answers[prompt.key].text, len(prompt.identifiers))
                for run, answers in runs.items()}
        for n, asked in enumerate(prompt.identifiers):
            count += 1
            made = {run: identifiers.edits(asked, back[run][n]) for run in runs}
            for run in runs:
                totals[run] += made[run]
            if back["baseline_run_1"][n] != back["baseline_run_2"][n]:
                between["identifiers"] += 1
                between["edits"] += identifiers.edits(back["baseline_run_1"][n] or "", back["baseline_run_2"][n] or "")
            over = made["canary_run_1"] - max(made["baseline_run_1"], made["baseline_run_2"])
            if over > 0:
                beyond += over
                edited.append({"identifier": asked, "prompt": prompt.key, "number": n + 1,
                               "baseline": back["baseline_run_1"][n], "canary": back["canary_run_1"][n],
                               "baseline_edits": made["baseline_run_1"], "canary_edits": made["canary_run_1"]})
    body = {"count": count, "edits": totals, "baseline_run_to_run": between, "beyond_baseline": beyond,
            "edited": edited}
    if not count:
        return body, ([Finding("canary", "identifiers", FAIL, f"no identifier was compared: all {unanswered_prompts} "
                                                              "identifier prompts got no answer")]
                      if unanswered_prompts else [])
    skipped = f"; {unanswered_prompts} identifier prompts got no answer and are not counted" if unanswered_prompts else ""
    summary = (f"{plural(beyond, 'edit')} beyond the baseline's over {plural(count, 'identifier')} (the canary's "
               f"{totals['canary_run_1']}, the baseline's {totals['baseline_run_1']} and {totals['baseline_run_2']}; "
               f"the baseline's two runs differ on {plural(between['identifiers'], 'identifier')}){skipped}")
    found = [Finding("canary", "identifiers", FAIL,
                     f"identifier {e['identifier']!r} ({e['prompt']} #{e['number']}) came back {e['canary']!r} from "
                     f"the canary ({plural(e['canary_edits'], 'edit')}), {e['baseline']!r} from the baseline "
                     f"({plural(e['baseline_edits'], 'edit')})") for e in edited[:SHOWN]]
    found.append(Finding("canary", "identifiers", FAIL if beyond else OK, summary))
    return body, found
