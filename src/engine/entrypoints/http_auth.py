"""Who may call which route: --api-key for the API, --admin-api-key for the operator routes.

SGLang's rules (its `--admin-api-key`, the routes it marks ADMIN_OPTIONAL):

    route            neither key   --api-key only   --admin-api-key only   both
    /health          open          open             open                   open
    operator route   open          api key          admin key              admin key (api key refused)
    any other route  open          api key          open                   api key

Operator routes change the server for everyone: weights, memory, pause/continue, /flush_cache,
/abort_request (which ends other users' requests). Keys are compared in constant time; a refusal is
a 401 that names the key wanted, never whether the one sent was close.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import FrozenSet, Optional

# Routes that answer without a key: load balancers probe liveness without credentials.
UNAUTHENTICATED_PATHS = frozenset({"/health"})
# Operator routes defined by http_server.py itself; those of control_routes.py join them there.
OPERATOR_PATHS = frozenset({"/flush_cache", "/abort_request"})

API_KEY_REFUSAL = "Invalid or missing API key: send 'Authorization: Bearer <key>'."
ADMIN_KEY_REFUSAL = ("This is an operator route: send the admin API key (--admin-api-key) as "
                     "'Authorization: Bearer <key>'.")


@dataclass(frozen=True)
class ApiKeys:
    api_key: Optional[str] = None
    admin_api_key: Optional[str] = None
    operator_paths: FrozenSet[str] = field(default=OPERATOR_PATHS)

    def refusal(self, path: str, authorization: str) -> Optional[str]:
        """Why a request for `path` with this Authorization header is refused; None: let it in."""
        if path in UNAUTHENTICATED_PATHS:
            return None
        if path in self.operator_paths and self.admin_api_key:
            return None if _bearer_matches(authorization, self.admin_api_key) else ADMIN_KEY_REFUSAL
        if self.api_key:
            return None if _bearer_matches(authorization, self.api_key) else API_KEY_REFUSAL
        return None


def _bearer_matches(authorization: str, key: str) -> bool:
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), key.encode())
