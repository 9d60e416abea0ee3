"""Routes whose JSON bodies are parsed by orjson: a long agent history is read three times faster
than by the standard library's parser, which FastAPI uses by default."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.routing import Match
from starlette.types import Scope

from proxy.api.limits import replaying


class IndexedHeaders(Headers):
    """Starlette's request headers, each name's first value found through a dict built on the first
    lookup: a turn looks up ten names (key, session, group, retry, content type), most of them
    absent, and each lookup was a scan of the whole list."""

    _index: dict[str, str]

    def _first_values(self) -> dict[str, str]:
        index: dict[str, str] | None = self.__dict__.get("_index")
        if index is None:
            # Reversed: the first of repeated names is kept, as Headers.__getitem__ finds it.
            index = {name.decode("latin-1"): value.decode("latin-1") for name, value in reversed(self._list)}
            self._index = index
        return index

    def __getitem__(self, key: str) -> str:
        found = self._first_values().get(key.lower())
        if found is None:
            raise KeyError(key)
        return found

    def __contains__(self, key: Any) -> bool:
        return key.lower() in self._first_values()

    def get(self, key: str, default: Any = None) -> Any:
        return self._first_values().get(key.lower(), default)


class OrjsonRequest(Request):
    @property
    def headers(self) -> Headers:
        if not hasattr(self, "_headers"):
            self._headers = IndexedHeaders(scope=self.scope)
        return self._headers

    async def body(self) -> bytes:
        """Starlette's body, read without its stream generator when it comes as one message (as
        BodyLimit, in front of every route, hands it on)."""
        if not hasattr(self, "_body") and not self._stream_consumed:
            message = await self._receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                self._body: bytes = message.get("body", b"")
                self._stream_consumed = True
            else:  # in parts, or a disconnect: Starlette reads it, this message first
                self._receive = replaying(message, self._receive)
        return await super().body()

    async def json(self) -> Any:
        # orjson.JSONDecodeError is a json.JSONDecodeError: FastAPI still answers a malformed body
        # with its validation error, which the error handlers turn into a 400.
        if not hasattr(self, "_json"):
            self._json = orjson.loads(await self.body())
        return self._json


class OrjsonRoute(APIRoute):
    request_class: type[OrjsonRequest] = OrjsonRequest

    def __init__(self, path: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        # The path's text after its last parameter: a request path that does not end with it cannot
        # match (Starlette's pattern ends with it, included under a prefix or not), so the router,
        # which tries its routes in order, passes this one by a string test instead of a match
        # (a turn's route comes after several others).
        self._path_tail = path.rsplit("}", 1)[-1]

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] == "http" and not scope["path"].endswith(self._path_tail):
            return Match.NONE, {}
        return super().matches(scope)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        request_class = self.request_class

        async def parsed_by_orjson(request: Request) -> Response:
            return await handler(request_class(request.scope, request.receive))

        return parsed_by_orjson
