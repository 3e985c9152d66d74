"""Token ids -> text pieces as they stream, with OpenAI's `stop` strings.

Decoding the whole answer again for every token costs O(n^2); decoding only the newest token
breaks characters whose UTF-8 bytes span tokens and words whose spacing depends on the token
before. So we decode a short window: the tokens since the last emitted piece together with the
one before them, and emit what that adds to the window's earlier text, holding it back while it
ends in an incomplete character (U+FFFD). vLLM's incremental detokenizer works the same way.

A stop string ends the answer before it (the stop string itself is not returned). Text that could
still be the start of a stop string is held back until the next token decides it.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feed token ids with `push`; it returns the text they add and whether a stop string ended it.

    skip_ids: tokens never shown as text (the end tokens that finished the answer).
    """

    def __init__(self, tokenizer, stop: list[str] = (), skip_ids=()):
        self.tokenizer, self.stop, self.skip = tokenizer, list(stop), set(skip_ids)
        self.ids: list[int] = []     # shown tokens, decoded in windows
        self.window_start = 0        # the window is ids[window_start:]; ids[:read] are already in text
        self.read = 0
        self.text = ""               # everything decoded so far
        self.sent = 0                # characters of text returned
        self.num_tokens = 0          # tokens pushed, skipped ones included
        self.stopped = False

    def push(self, token_ids, final: bool = False) -> str:
        """The text `token_ids` add that is safe to show (all of it if `final`)."""
        if self.stopped:
            return ""
        for token in token_ids:
            self.num_tokens += 1
            if token not in self.skip:
                self.ids.append(int(token))
        self._decode(final)
        return self._release(final)

    def _decode(self, final: bool) -> None:
        if self.read == len(self.ids):
            return
        before = self.tokenizer.decode(self.ids[self.window_start:self.read])
        after = self.tokenizer.decode(self.ids[self.window_start:])
        if after.endswith(REPLACEMENT) and not final:
            return                    # a character is still incomplete: wait for its next byte
        self.text += after[len(before):]
        self.window_start, self.read = self.read, len(self.ids)

    def _release(self, final: bool) -> str:
        """Text up to the first stop string, keeping back a tail that may begin one."""
        longest = max((len(s) for s in self.stop), default=0)
        search_from = max(0, self.sent - longest + 1)
        hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
        if hits:
            end, self.stopped = min(hits), True
        elif final or not self.stop:
            end = len(self.text)
        else:
            held = max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
            end = len(self.text) - held
        piece = self.text[self.sent:max(end, self.sent)]
        self.sent = max(end, self.sent)
        return piece


__all__ = ["IncrementalDetokenizer"]
