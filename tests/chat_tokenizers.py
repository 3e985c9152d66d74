"""A tokenizer with a chat template for the toy models' chat tests (test_chat, test_chat_repl)."""

from adapters import get_tokenizer


class ChatMLBytes:
    """The toy models' byte tokenizer with a ChatML-style template written here (a session must use it as
    given); the toy model's one special token, <|endoftext|>, ends a message."""

    chat_template = "test"

    def __init__(self):
        self.inner = get_tokenizer()
        self.stop_ids = [self.inner.eot_id]
        self.vocab_size = self.inner.vocab_size

    def encode(self, text):
        return self.inner.encode(text)

    def decode(self, ids):
        return self.inner.decode(ids)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        text = "".join(f"[{m['role']}] {m['content']}<|endoftext|>\n" for m in messages)
        return text + ("[assistant] " if add_generation_prompt else "")
