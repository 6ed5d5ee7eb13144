"""Passkey retrieval prompts in real text (``long_eval.py``, part b).

A random 5-7 digit number in a sentence (``NEEDLE``: "The pass key is 48213. Remember
it. 48213 is the pass key.") is hidden in a window of real text (the haystack, a token
stream of the corpus's documents) at a depth of the haystack -- 0 is right after the
instruction, 1 right before the question -- moved to the nearest sentence end within 2%
of the haystack (or 8 tokens) so that it does not split a sentence.  The instruction
(``INTRO``), the haystack and the question (``QUESTION``) form the user's message,
rendered by the model's chat template (``render``: ``tok.render_chat``), and the whole
prompt is exactly ``length`` tokens: the template's text before and after the haystack
is tokenized once (``PasskeyPrompts.head`` / ``tail``), the haystack and the needle are
spliced in as tokens.  The assistant's turn opens with ``ANSWER`` ("The pass key is"), so
that the model's next tokens are the number (asked only "What is the pass key?",
SmolLM2-135M-Instruct defined the phrase instead -- "The pass key is a piece of cloth
..." -- in all 40 prompts of the first H100 run, the key right before the question
included).  Without a chat template the prompt is plain text ending in ``ANSWER``.  An answer is correct when the number
appears in it, not as part of a longer number (``correct``).
"""

from __future__ import annotations

import re

import numpy as np

INTRO = ("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize "
         "it. I will quiz you about the pass key.")
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key?"
ANSWER = "The pass key is"
MARK = "\u241fHAYSTACK\u241f"          # where the haystack goes in the rendered template
_ENDS = (".", "!", "?", "\n", '."', ".'", ".\u201d")


def chat_renderer(tokenizer):
    """``render(messages) -> str`` from the tokenizer's chat template, or None when it has
    none (a GGUF's ``render_chat`` / ``chat_template``)."""
    if getattr(tokenizer, "chat_template", None) and hasattr(tokenizer, "render_chat"):
        return tokenizer.render_chat
    return None


def random_key(rng) -> str:
    """A random number of 5 to 7 digits (no leading zero)."""
    digits = int(rng.integers(5, 8))
    return str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))


def correct(answer: str, key: str) -> bool:
    """Whether ``key`` appears in ``answer`` as a whole number."""
    return re.search(rf"(?<!\d){re.escape(key)}(?!\d)", answer) is not None


class PasskeyPrompts:
    """Prompts of ``length`` tokens with a pass key at a depth (module docstring).

    ``haystack``: int token stream of real text (``Documents``' documents one after
    another); ``render``: the chat template (``chat_renderer``) or None for plain text.
    """

    def __init__(self, tokenizer, haystack, render=None):
        self.tok = tokenizer
        self.hay = np.asarray(haystack, np.int32)
        content = f"{INTRO}\n\n{MARK}\n\n{QUESTION}"
        if render is not None:
            text = render([{"role": "user", "content": content}]) + ANSWER
        else:
            text = f"{content} {ANSWER}"
        if text.count(MARK) != 1:
            raise ValueError("the chat template did not keep the message text whole")
        head, tail = text.split(MARK)
        self.head = np.asarray(tokenizer.encode(head), np.int32)
        self.tail = np.asarray(tokenizer.encode(tail), np.int32)

    def _ends_sentence(self, token) -> bool:
        return self.tok.decode([int(token)]).rstrip(" ").endswith(_ENDS)

    def _snap(self, hay, at: int) -> int:
        """The position nearest to ``at`` right after a sentence end, within 2% of the
        haystack or 8 tokens (``at`` itself when there is none, and at the very start or
        end)."""
        if at <= 0 or at >= len(hay):
            return at
        reach = max(8, len(hay) // 50)
        for step in range(reach + 1):
            for cand in (at - step, at + step):
                if 0 < cand < len(hay) and self._ends_sentence(hay[cand - 1]):
                    return cand
        return at

    def make(self, rng, length: int, depth: float):
        """``(ids [length] int32, key, needle_start, actual_depth)``: one prompt with a new
        random key, its haystack a random window of the stream (wrapping around when the
        stream is shorter)."""
        key = random_key(rng)
        needle = np.asarray(self.tok.encode(NEEDLE.format(key=key)), np.int32)
        n_hay = length - len(self.head) - len(self.tail) - len(needle)
        if n_hay < 1:
            raise ValueError(f"length={length} leaves no room for the haystack (template "
                             f"{len(self.head) + len(self.tail)} + needle {len(needle)} "
                             f"tokens)")
        start = int(rng.integers(0, max(1, len(self.hay) - n_hay)))
        hay = np.resize(np.roll(self.hay, -start), n_hay)
        at = self._snap(hay, int(round(depth * n_hay)))
        ids = np.concatenate([self.head, hay[:at], needle, hay[at:], self.tail])
        assert len(ids) == length, (len(ids), length)
        return ids, key, len(self.head) + at, at / n_hay
