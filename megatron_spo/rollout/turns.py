"""A multi-turn conversation as token ids: the model's turns exactly as the engine sampled them, the environment's
observations tokenised once between them (docs/multi-turn.md).

    fmt = TurnFormat(tokenizer, max_observation_tokens=256)
    conv = Conversation(prompt.tokens)
    conv.add_model_turn(completion)                       # output ids, log-probs, weight versions of one /generate
    conv.add_observation(*fmt.observation(text, completion.output_ids))
    conv.ids                                              # the next turn's input_ids

With a chat template, an observation is a user turn: the template's text after an assistant message (its end-of-turn
marker, unless the model's turn already ended with that token), the user turn's header, the observation, the user
turn's end and the assistant turn's header (the generation prompt), read off the template itself. Without one (the
toy tasks' character tokenizer) it is PLAIN_HEAD + observation + PLAIN_TAIL. The markers are tokenised as the
template's special tokens; the observation's own text never is (``split_special_tokens``): a program printing
'<|im_end|>' cannot end a turn. The model's own tokens are never decoded and encoded again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_spo.environments.base import escape_text
from megatron_spo.rollout.protocol import Completion

PLAIN_HEAD, PLAIN_TAIL = "\n\nFeedback:\n", "\n\nSolution:\n"
CUT_MARK = "\n[... cut]"
MAX_CHARS_PER_TOKEN = 64  # an observation's text is cut to max_observation_tokens x this before it is tokenised
# stand-ins for the contents of a rendered conversation, to read the template's own text around them
_USER, _ASSISTANT, _OBSERVATION = "MSPO-USER-3f1c", "MSPO-ASSISTANT-3f1c", "MSPO-OBSERVATION-3f1c"


def chat_markers(tokenizer: Any) -> tuple[str, str, str]:
    """(after an assistant message, the user turn's header, its end + the generation prompt) of the tokenizer's chat
    template; ValueError in one line when the template does not extend a conversation by appending to it."""
    base = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
    first = tokenizer.apply_chat_template(base, tokenize=False)
    full = tokenizer.apply_chat_template(base + [{"role": "user", "content": _OBSERVATION}], tokenize=False,
                                         add_generation_prompt=True)
    if not full.startswith(first) or first.count(_ASSISTANT) != 1 or full.count(_OBSERVATION) != 1:
        raise ValueError("the tokenizer's chat template does not render a conversation with one more user turn as "
                         "the same text plus that turn: multi-turn rollouts need one that does")
    head, tail = full[len(first):].split(_OBSERVATION)
    return first[first.index(_ASSISTANT) + len(_ASSISTANT):], head, tail


class TurnFormat:
    """How an observation becomes token ids between two model turns (module docstring). ``stop_token_ids``: the
    template's end-of-turn token when it is one special token (sent with every turn, so the engine ends a turn there
    whatever its EOS), else None."""

    def __init__(self, tokenizer: Any, *, max_observation_tokens: int):
        self.tokenizer, self.max_tokens = tokenizer, max_observation_tokens
        if getattr(tokenizer, "chat_template", None):
            after, head, tail = chat_markers(tokenizer)
        else:
            after, head, tail = "", PLAIN_HEAD, PLAIN_TAIL
        end = next((t for t in sorted(_special_tokens(tokenizer), key=len, reverse=True) if t and after.startswith(t)),
                   "")
        self.end_ids = self._encode(end) if end else []
        self.head, self.head_after_end, self.tail = after + head, after[len(end):] + head, tail
        self.head_ids = self._encode(self.head)  # the model's turn did not end with the end-of-turn token
        self.head_after_end_ids = self._encode(self.head_after_end) if end else self.head_ids
        self.tail_ids = self._encode(tail)
        self.cut_ids = self._encode(CUT_MARK, plain=True)
        self.stop_token_ids = list(self.end_ids) if len(self.end_ids) == 1 else None

    def _encode(self, text: str, plain: bool = False) -> list[int]:
        if not text:
            return []
        kwargs = {"split_special_tokens": True} if plain else {}
        return list(self.tokenizer(text, add_special_tokens=False, **kwargs)["input_ids"])

    def observation(self, text: str, model_turn: list[int]) -> tuple[list[int], str]:
        """(token ids, their text) of an observation after a model turn of ids ``model_turn``; the observation's own
        tokens cut to max_observation_tokens (CUT_MARK at the end), its control characters escaped
        (environments/base.escape_text)."""
        ended = bool(self.end_ids) and model_turn[-len(self.end_ids):] == self.end_ids
        head, head_ids = (self.head_after_end, self.head_after_end_ids) if ended else (self.head, self.head_ids)
        text = escape_text(text[:self.max_tokens * MAX_CHARS_PER_TOKEN])  # no tokenising megabytes to keep a few
        content = self._encode(text, plain=True)
        if len(content) > self.max_tokens:
            keep = max(self.max_tokens - len(self.cut_ids), 0)
            content = content[:keep] + self.cut_ids[:self.max_tokens - keep]
            text = self.tokenizer.decode(content[:keep], skip_special_tokens=False) + CUT_MARK
        return head_ids + content + self.tail_ids, head + text + self.tail

    def context(self, text: str) -> list[int]:
        """An environment's first observation (reset), appended to the prompt as it is (no turn markers)."""
        return self._encode(escape_text(text[:self.max_tokens * MAX_CHARS_PER_TOKEN]), plain=True)[:self.max_tokens]


def _special_tokens(tokenizer: Any) -> set[str]:
    tokens = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    tokens.update(t.content for t in decoder.values() if getattr(t, "special", False))
    return tokens


@dataclass
class Conversation:
    """One conversation's tokens: ``prompt`` (the task's prompt and a reset observation), then the response: every
    model turn and observation after it, with the mask (1: the model's), behaviour log-probs (0.0 on the
    environment's tokens), each model turn's weight versions (oldest first) and the engine's version spans."""

    prompt: list[int]
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_versions: list[list[str]] = field(default_factory=list)
    spans: list[tuple[str, int, int]] = field(default_factory=list)  # over the response
    texts: list[str] = field(default_factory=list)  # the model's turns and the observations, in order
    model_texts: list[str] = field(default_factory=list)
    retracted: bool = False

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.response

    def add_model_turn(self, c: Completion) -> None:
        start = len(self.response)
        self.response += c.output_ids
        self.mask += [1] * len(c.output_ids)
        self.logprobs += list(c.logprobs or [])
        self.turn_versions.append(c.versions)
        self.spans += [(v, start + s, start + e) for v, s, e in (c.weight_versions or
                                                                  [(c.weight_version, 0, len(c.output_ids))])]
        self.texts.append(c.text)
        self.model_texts.append(c.text)
        self.retracted |= c.num_retractions > 0

    def add_observation(self, ids: list[int], text: str) -> None:
        self.response += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.texts.append(text)
