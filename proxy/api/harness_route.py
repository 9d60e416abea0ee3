"""The routes a harness calls to run a turn, without FastAPI's dependency solver on the hot path.

Their signatures stay FastAPI's (a body model, the app state, the session, the request; the harness
key and the group headers from the router), so /openapi.json documents them and FastAPI answers
anything unusual. A well-formed JSON body that its model accepts takes a shorter road: the same
checks, in the order FastAPI's solver makes them, as one plain function reading the request's
headers (`harness_inputs`), then the endpoint. The generic solver cost more than the checks.

The routes read the session id from the path themselves (the same endpoint serves `/v1/...` and
`/sessions/{session_id}/v1/...`), so nothing in their signatures declares it: `include_flat` adds a
dependency declaring each path parameter nothing else declares, or the schema would name a path
parameter it never defines (an invalid OpenAPI document).
"""

from __future__ import annotations

import inspect
import typing
import uuid
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request, Response, params
from fastapi import routing as fastapi_routing
from fastapi.dependencies.utils import get_dependant, get_flat_params, get_parameterless_sub_dependant
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.convertors import Convertor, FloatConvertor, IntegerConvertor, UUIDConvertor
from starlette.routing import compile_path
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.api.auth import check_harness_key, require_harness_key
from proxy.api.deps import get_state, resolve_session_id, session_of
from proxy.api.groups import group_from_headers, join_group
from proxy.api.json_route import OrjsonRoute
from proxy.app_state import AppState
from proxy.errors import ProxyError

Handler = Callable[[Request], Coroutine[Any, Any, Response]]
# The dependencies the plain function stands for, in the order FastAPI solves them.
_ROUTER_DEPENDENCIES = (require_harness_key, group_from_headers)
_PARAMETER_DEPENDENCIES = {get_state: "state", resolve_session_id: "session"}


async def harness_inputs(request: Request) -> tuple[AppState, tuple[str, bool]]:
    """What a harness route's dependencies give, checked as they check it: the key (401), the
    session (400 for a bad id or one the header contradicts), the group headers (400, 409)."""
    state: AppState = request.app.state.proxy
    headers = request.headers
    check_harness_key(state.settings, headers)
    session = session_of(
        request.path_params.get("session_id"), headers.get("x-session-id"), headers.get("idempotency-key")
    )
    await join_group(state, request.method, request.scope["path"], session[0], headers)
    return state, session


@dataclass(frozen=True)
class _Call:
    """How the endpoint is called without the solver: its body model and its parameters' roles."""

    endpoint: Callable[..., Coroutine[Any, Any, Response]]
    model: type[BaseModel]
    roles: dict[str, str]  # parameter name -> body, state, session or request

    async def __call__(self, request: Request) -> Response | None:
        """The answer, or None when FastAPI must read the request (anything but a JSON object
        its model accepts: FastAPI's errors, in its order, are the answer then)."""
        if not _is_json(request.headers.get("content-type")):
            return None
        try:
            data = await request.json()
        except Exception:  # FastAPI reads it again and answers as it always does (400)
            return None
        try:  # a chat body may come validated already (proxy/api/message_prefix.py)
            body = data if type(data) is self.model else self.model.model_validate(data)
        except ValidationError:
            return None
        state, session = await harness_inputs(request)
        given = {"body": body, "state": state, "session": session, "request": request}
        return await self.endpoint(**{name: given[role] for name, role in self.roles.items()})


def _is_json(content_type: str | None) -> bool:
    return content_type is not None and content_type.partition(";")[0].strip().lower() == "application/json"


def _roles(endpoint: Callable[..., Any]) -> dict[str, str] | None:
    """Each parameter's role, or None when one is something the plain path does not provide."""
    hints = typing.get_type_hints(endpoint, include_extras=True)
    roles = {}
    for name in inspect.signature(endpoint).parameters:
        hint = hints.get(name)
        depends = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, params.Depends)]
        if depends and depends[0].dependency in _PARAMETER_DEPENDENCIES:
            roles[name] = _PARAMETER_DEPENDENCIES[depends[0].dependency]
        elif inspect.isclass(hint) and issubclass(hint, Request):
            roles[name] = "request"
        elif inspect.isclass(hint) and issubclass(hint, BaseModel) and "body" not in roles.values():
            roles[name] = "body"
        else:
            return None
    return roles if "body" in roles.values() else None


def _included(route: APIRoute) -> Any:
    """The route as this inclusion builds it (its path and dependencies include the router's)."""
    # Since FastAPI 0.16x an included route is built under a context naming its inclusion; earlier
    # releases copy the route, which then holds them itself.
    context_var = getattr(fastapi_routing, "_effective_route_context_var", None)
    context = context_var.get() if context_var is not None else None
    return context if context is not None and context.original_route is route else route


def _plain_call(route: APIRoute) -> _Call | None:
    """The plain call of this route as included (the router's dependencies count), or None where it
    would not do exactly what FastAPI does."""
    # The path's parameters need no check: the path matched, so each is there, already converted.
    dependencies = tuple(
        d.dependency for d in _included(route).dependencies if not isinstance(d.dependency, PathParameters)
    )
    returns = inspect.signature(route.endpoint, eval_str=True).return_annotation
    roles = _roles(route.endpoint)
    if (
        dependencies != _ROUTER_DEPENDENCIES
        or roles is None
        or not (inspect.isclass(returns) and issubclass(returns, Response))
    ):
        return None
    model = typing.get_type_hints(route.endpoint)[next(n for n, r in roles.items() if r == "body")]
    return _Call(route.endpoint, model, roles)


# Where the route's own ASGI app leaves the request it read for FastAPI's handler (below).
_READ_REQUEST = "tito.harness_request"


class _NotPlain(BaseException):
    """The plain call does not answer this request: FastAPI's handler must (see _plain_first). A
    BaseException: a subclass's handler wrapper that answers every Exception (Anthropic's error
    shape) passes it on to _plain_first instead of answering it as an error."""


class HarnessRoute(OrjsonRoute):
    """A turn route: its documented FastAPI handler, and the plain call tried first (see above)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.plain_paths: set[str] = set()  # where it is included with the plain call
        self._plain_only = False
        super().__init__(*args, **kwargs)
        if self.max_body_size is None and _plain_call(self) is not None:
            # The handler chain again (a subclass's wrappers included) around the plain call alone.
            self._plain_only = True
            try:
                plain_handler = self.get_route_handler()
            finally:
                self._plain_only = False
            self.app = _plain_first(plain_handler, self.request_class, self.app)

    def get_route_handler(self) -> Handler:
        plain = _plain_call(self)
        if self._plain_only:
            assert plain is not None
            return _plain_or_raise(plain)
        solved = APIRoute.get_route_handler(self)
        request_class = self.request_class

        async def handler(request: Request) -> Response:
            read = request.scope.pop(_READ_REQUEST, None)
            if read is not None:  # _plain_first tried the plain call with this request (or passed it over)
                return await solved(read)
            request = request_class(request.scope, request.receive)
            if plain is not None and not request.app.dependency_overrides:
                answered = await plain(request)
                if answered is not None:
                    return answered
            return await solved(request)

        if plain is not None:
            self.plain_paths.add(_included(self).path)
        return handler


def _plain_or_raise(plain: _Call) -> Handler:
    async def handler(request: Request) -> Response:
        answered = await plain(request)
        if answered is None:
            raise _NotPlain
        return answered

    return handler


def _plain_first(plain_handler: Handler, request_class: type[Request], solved_app: ASGIApp) -> ASGIApp:
    """The ASGI app of a route included flat: the plain call answers on its own, outside FastAPI's
    request_response (two exit stacks, an exception wrapper and two request objects a turn, which
    only the solver's dependencies use); what it does not answer goes to FastAPI's app, given the
    request as read (its body is read once). An exception from the plain call reaches the app's
    ExceptionMiddleware, whose handlers answer it as request_response's own wrapper would."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        request = request_class(scope, receive, send)
        if not scope["app"].dependency_overrides:
            try:
                answered = await plain_handler(request)
            except _NotPlain:
                pass
            else:
                await answered(scope, receive, send)
                return
        scope[_READ_REQUEST] = request
        await solved_app(scope, receive, send)

    return app


# The type of a path parameter a convertor gives (starlette's str and path convertors give a str).
_CONVERTED: dict[type[Convertor[Any]], type] = {
    IntegerConvertor: int,
    FloatConvertor: float,
    UUIDConvertor: uuid.UUID,
}


class PathParameters:
    """A dependency declaring path parameters, so that the schema documents them (`in: path`,
    required) and FastAPI's solver validates them as the path gave them. It checks nothing else."""

    def __init__(self, convertors: dict[str, Convertor[Any]]) -> None:
        self.__signature__ = inspect.Signature(
            [
                inspect.Parameter(
                    name,
                    inspect.Parameter.KEYWORD_ONLY,
                    annotation=typing.Annotated[_CONVERTED.get(type(convertor), str), params.Path()],
                )
                for name, convertor in convertors.items()
            ]
        )

    async def __call__(self, **values: Any) -> None:
        return None


def undeclared_path_parameters(
    path: str, endpoint: Callable[..., Any], dependencies: Sequence[params.Depends]
) -> list[params.Depends]:
    """A dependency declaring the parameters of `path` that neither the endpoint nor its dependencies
    declare (a prefix's `{session_id}` the endpoint reads from `request.path_params`), or none."""
    dependant = get_dependant(path=path, call=endpoint)
    dependant.dependencies.extend(get_parameterless_sub_dependant(depends=d, path=path) for d in dependencies)
    fields = get_flat_params(dependant)
    declared = {field.alias for field in fields if isinstance(field.field_info, params.Path)}
    convertors = compile_path(path)[2]
    missing = {name: convertor for name, convertor in convertors.items() if name not in declared}
    return [Depends(PathParameters(missing))] if missing else []


def include_flat(app: FastAPI, router: APIRouter, *, prefix: str = "", dependencies: list[Any]) -> None:
    """`app.include_router(router, prefix=..., dependencies=...)` as FastAPI did it before 0.16x: the
    router's routes copied into the app's, each matched directly. Since 0.16x an included router
    is its own matching layer, ~5-10 µs a request for each one passed on the way to the route;
    the harness's routes sit behind ten of them. Same routes, order, names and schema, except that
    every parameter of a route's path is declared (see undeclared_path_parameters)."""
    for route in router.routes:
        if not isinstance(route, APIRoute):
            raise TypeError(f"{route!r}: only API routes are included flat")
        path = prefix + route.path
        own = [*dependencies, *route.dependencies]
        app.router.add_api_route(
            path,
            route.endpoint,
            response_model=route.response_model,
            status_code=route.status_code,
            tags=route.tags,
            dependencies=[*undeclared_path_parameters(path, route.endpoint, own), *own],
            summary=route.summary,
            description=route.description,
            response_description=route.response_description,
            responses=route.responses,
            deprecated=route.deprecated,
            methods=route.methods,
            operation_id=route.operation_id,
            response_model_include=route.response_model_include,
            response_model_exclude=route.response_model_exclude,
            response_model_by_alias=route.response_model_by_alias,
            response_model_exclude_unset=route.response_model_exclude_unset,
            response_model_exclude_defaults=route.response_model_exclude_defaults,
            response_model_exclude_none=route.response_model_exclude_none,
            include_in_schema=route.include_in_schema,
            response_class=route.response_class,
            name=route.name,
            route_class_override=type(route),
            callbacks=route.callbacks,
            openapi_extra=route.openapi_extra,
            generate_unique_id_function=route.generate_unique_id_function,
        )


class FieldNamedRoute(HarnessRoute):
    """A turn route whose errors name request fields as its dialect's request does: the turn core
    speaks chat's names (`messages`, `max_tokens`, `response_format`)."""

    field_names: typing.ClassVar[dict[str, str]] = {}

    def get_route_handler(self) -> Handler:
        handler = super().get_route_handler()
        names = self.field_names

        async def in_dialect_terms(request: Request) -> Response:
            try:
                return await handler(request)
            except ProxyError as exc:
                exc.param = names.get(exc.param, exc.param) if exc.param is not None else None
                raise

        return in_dialect_terms
