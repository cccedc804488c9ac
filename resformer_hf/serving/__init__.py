"""`resformer-serve`: what it adds to `transformers serve`, one concern a module: the server's patches (`server`),
request checks that answer 400 (`checks`), `n` > 1 and lists of prompts (`fanout`), OpenAI's sampling semantics
(`sampling`), `stop` (`stops`), log-probabilities and `echo` (`logprobs`), OpenAI's shape on every error answer
(`openai_errors`), and the ASGI plumbing every request goes through: its body, its content-length, answers
(`asgi`)."""
