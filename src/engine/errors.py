"""Errors the runtime raises toward the HTTP layer and the offline Engine."""

from __future__ import annotations


# nginx's status for "the client went away first": the answer to a request whose client left.
CLIENT_CLOSED_REQUEST = 499


class EngineRequestError(Exception):
    """A request the engine refuses: the client's fault (400), overload (503), or a dead server (503)."""

    def __init__(self, message: str, status_code: int = 400, err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.err_type = err_type

    def __repr__(self) -> str:
        return f"EngineRequestError({self.message!r}, status_code={self.status_code}, err_type={self.err_type!r})"


# A server runs either a generative or an embedding model (as in SGLang); a request of the other
# kind gets a 400 with one of these (the first is SGLang's own wording).
NOT_AN_EMBEDDING_MODEL = ("This model does not appear to be an embedding model by default. Please add "
                          "`--is-embedding` when launching the server or try another model.")
NOT_A_GENERATION_MODEL = ("This server runs an embedding model, which does not generate text: use "
                          "/v1/embeddings, /encode or Engine.encode.")
