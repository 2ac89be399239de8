"""OpenAPI descriptions of the error responses every route may give."""

from typing import Any

from app.schemas import ErrorResponse

_E = {"model": ErrorResponse}
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {**_E, "description": "Invalid input; `param` names the field."},
    401: {**_E, "description": "Missing or wrong API key."},
    404: {**_E, "description": "Unknown model or session."},
    413: {**_E, "description": "Request body too large."},
    429: {**_E, "description": "Quota exceeded or queue full; see `Retry-After`."},
    503: {**_E, "description": "Loading or shutting down."},
}
