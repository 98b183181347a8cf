"""A request for a path no door serves: a 404 that names the APIs ctxgate serves, in the
shape the client's API would use (Google's under `/v1beta/`, else OpenAI's, which the
Anthropic SDK reads too), logged once per path so an operator sees which agent is lost."""
from __future__ import annotations

import logging
import re

from aiohttp import web

from ..errors import ErrorKind, GatewayError
from .errors import openai_response
from .gemini_replies import google_response

log = logging.getLogger("ctxgate.doors")
SERVED = ("ctxgate serves: OpenAI Chat Completions (POST /v1/chat/completions), OpenAI Responses "
          "(POST /v1/responses), Anthropic Messages (POST /v1/messages) and Gemini "
          "(POST /v1beta/models/{model}:generateContent, :streamGenerateContent, :countTokens, also /v1/models/...), "
          "each also under "
          "/s/<session>/")
_GOOGLE = re.compile(r"/v1beta/|/v1/models/[^/]+:")
_LOGGED: set[str] = set()
_MAX_LOGGED = 1000


def _error(path: str) -> GatewayError:
    hint = ""
    if re.search(r"/v1/v1(beta)?/", path):
        hint = " (a Gemini client's base URL is ctxgate's address without /v1)"
    return GatewayError(ErrorKind.NOT_FOUND, f"no API at {path}{hint}; {SERVED}", code="not_found")


def not_found(request: web.Request) -> web.Response:
    if request.path not in _LOGGED and len(_LOGGED) < _MAX_LOGGED:
        _LOGGED.add(request.path)
        log.warning("no API at %s %s (asked by %s)", request.method, request.path,
                    request.headers.get("User-Agent", "an unnamed client"))
    error = _error(request.path)
    return google_response(error) if _GOOGLE.search(request.path) else openai_response(error)
