"""The admin routes (``/api/hub/``, the admin credential as a bearer): every job with its
reports, the runners, the front door's sessions and turns in flight, usage, the API keys, the
counters; and ``GET /metrics``. docs/hub-api.md describes them."""

from __future__ import annotations

import math
import time
from typing import Any
from urllib.parse import parse_qs

from gateway.config import split_project
from gateway.hub.board import JobsView
from gateway.hub.hub import Hub
from gateway.hub.metrics import CONTENT_TYPE
from gateway.hub.money import KeyBudget, Price, budget_of, money
from gateway.hub.people import ADMIN, person
from gateway.hub.routekit import HTTPError, Request, bearer, json_object
from gateway.hub.runners import RunnerNotFound
from gateway.hub.snapshot import as_json
from gateway.hub.store import DEFAULT_KEY_PROJECT, HourlyUsage

MAX_KEY_BODY = 4096  # bytes: a key's name, project and limits
DAY = 24 * 3600
# the limits a key may be created with: JSON name -> Hub.create_api_key's keyword
LIMITS = {"rpm": "rpm", "tpm": "tpm", "tokensPerDay": "tokens_per_day", "maxStreams": "max_streams"}
NO_STORE = [(b"cache-control", b"no-store")]
PAGE_SESSION = "page_session"  # a request's scope key: it came with a person's page session
PRICE_FIELDS = ("input", "output", "referenceInput", "referenceOutput", "watts", "kwhPrice")


class AdminApi:
    """Every route behind the admin credential (``check`` runs before any of them)."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub

    def check(self, req: Request) -> None:
        """HTTPError 401/403 unless the admin credential was presented; a request with a page
        session's cookie instead is marked for ``People.authorize`` (before its handler)."""
        token = bearer(req.scope)
        if token is None:
            if self.hub.people.has_session(req):
                req.scope[PAGE_SESSION] = True
                return
            raise HTTPError(401, "the admin credential is required")
        if not self.hub.keys.is_admin(token):
            raise HTTPError(403, "only the admin credential may use /api/hub/")

    async def jobs(self, req: Request) -> None:
        """Every job with its reports: live ones from memory, ended ones from the store."""
        jobs = [job.admin_json() for job in await JobsView(self.hub.board).values()]
        await req.resp.json(200, {"jobs": jobs})

    async def sessions(self, req: Request) -> None:
        """The front door's live sessions: key name, session id, job, runner, turns, idle (on
        a team, every replica's: the store's)."""
        here = [as_json(s) for s in self.hub.snapshot().sessions]
        sessions = await self.hub.coordination.sessions_listing(here)
        await req.resp.json(200, {"sessions": sessions}, NO_STORE)

    async def replicas(self, req: Request) -> None:
        """The hubs sharing this one's store (this one alone without a team): id, URL,
        version, up, heartbeat age, channels held."""
        team, found = self.hub.coordination.picture()
        await req.resp.json(200, {"replicas": found, "team": team}, NO_STORE)

    async def counters(self, req: Request) -> None:
        """Pings sent, pong timeouts, channels declared dead, failovers (since the hub started)."""
        await req.resp.json(200, self.hub.counters.as_json())

    async def metrics(self, req: Request) -> None:
        """``GET /metrics``: the hub's Prometheus metrics (``gateway.hub.metrics``)."""
        body = self.hub.metrics.render(self.hub.snapshot()).encode()
        await req.resp.whole(200, body, [(b"content-type", CONTENT_TYPE.encode()), *NO_STORE])

    async def runners(self, req: Request) -> None:
        """Every runner seen lately: its registration, what it serves, whether it is up. A live
        runner whose models are not known yet is asked for them (the next read shows them). On
        a team, its sessions and turns in flight are counted on every replica (the store's)."""
        runners = []
        snapshot = self.hub.snapshot()
        unknown = {(r.owner, r.project) for r in snapshot.runners if r.up and r.models is None}
        for owner, project in sorted(unknown):
            await self.hub.catalog.discover(owner, project)
        # runner id -> (sessions, turns): a replica's, counted on every replica (else the snapshot's)
        held = await self.hub.coordination.held_by_runner([r.id for r in snapshot.runners])
        for runner in snapshot.runners:
            found = as_json(runner)
            if runner.id in held:
                found["sessions"], found["turnsInFlight"] = held[runner.id]
            found["labels"] = list(runner.labels)
            found["capabilities"] = (
                None if runner.capabilities is None else list(runner.capabilities)
            )
            found["models"] = None if runner.models is None else list(runner.models)
            runners.append(found)
        await req.resp.json(200, {"runners": runners}, NO_STORE)

    async def turns(self, req: Request) -> None:
        """The front-door turns in flight, with their pace (chunks a second since the first)."""
        turns = [as_json(t) for t in self.hub.snapshot().turns]
        await req.resp.json(200, {"turns": turns}, NO_STORE)

    async def usage(self, req: Request) -> None:
        """Hourly usage (``UsageBook.hourly``) since ``since`` (a Unix time; default: 24 h ago),
        of one key (``key``) or of all."""
        query = parse_qs(req.scope.get("query_string", b"").decode("latin-1"))
        since_text = (query.get("since") or [""])[0]
        if since_text:
            try:
                since = float(since_text)
            except ValueError:
                since = math.nan
            if not math.isfinite(since):
                raise HTTPError(400, '"since" must be a Unix time in seconds', "invalid_request")
        else:
            since = time.time() - DAY
        who = person(req)
        by = (query.get("by") or ["key"])[0]
        if by not in ("key", "person"):
            raise HTTPError(400, '"by" must be "key" or "person"', "invalid_request")
        if by == "person" or (who is not None and who.role != ADMIN):  # a member: their own
            sub = who.sub if who is not None and who.role != ADMIN else None
            usage_people = await self.hub.people.usage(since, sub)
            await req.resp.json(
                200, {"since": since, "by": "person", "usage": usage_people}, NO_STORE
            )
            return
        key = (query.get("key") or [None])[0] or None
        rows = await self.hub.accounting.hourly(since, key)
        usage = [
            {
                "hour": row.hour,
                "key": row.key_name,
                "model": row.model,
                "turns": row.turns,
                "promptTokens": row.prompt_tokens,
                "completionTokens": row.completion_tokens,
                "estimated": row.estimated,  # of ``turns``: tokens the hub's estimate
                "cost": row.cost,
                "referenceCost": row.ref_cost,
                "unpriced": row.unpriced,  # of ``turns``: their model had no price (cost 0)
            }
            for row in rows
        ]
        answer = {"since": since, "currency": self.hub.settings.currency, "usage": usage}
        answer["cost"] = cost_totals(rows)
        await req.resp.json(200, answer, NO_STORE)

    async def prices(self, req: Request) -> None:
        """``GET /api/hub/prices``: every model's price (a GPU-priced one as last derived)."""
        prices = await self.hub.accounting.prices()
        await req.resp.json(
            200,
            {
                "currency": self.hub.settings.currency,
                "prices": [p.as_json() for _model, p in sorted(prices.items())],
            },
            NO_STORE,
        )

    async def set_price(self, req: Request) -> None:
        """``POST /api/hub/prices`` ``{"model", "input", "output"}`` or ``{"model", "watts",
        "kwhPrice"}``, with ``"reference"``, ``"referenceInput"``, ``"referenceOutput"``."""
        body = json_object(await req.body(MAX_KEY_BODY))
        model = body.get("model")
        if not isinstance(model, str) or not model.strip() or len(model) > 200:
            raise HTTPError(400, '"model" must be a non-empty string', "invalid_request")
        reference = body.get("reference")
        if reference is not None and (not isinstance(reference, str) or len(reference) > 200):
            raise HTTPError(400, '"reference" must be a string', "invalid_request")
        values: dict[str, float | None] = {}
        for field in PRICE_FIELDS:
            try:
                values[field] = money(body.get(field), f'"{field}"')
            except ValueError as err:
                raise HTTPError(400, str(err), "invalid_request") from None
        gpu = values["watts"] is not None or values["kwhPrice"] is not None
        if gpu and (values["watts"] is None or values["kwhPrice"] is None):
            raise HTTPError(400, '"watts" and "kwhPrice" go together', "invalid_request")
        if not gpu and values["input"] is None and values["output"] is None:
            raise HTTPError(
                400,
                'a price needs "input" and "output", or "watts" and "kwhPrice"',
                "invalid_request",
            )
        price = Price(
            model,
            values["input"] or 0.0,
            values["output"] or 0.0,
            reference,
            values["referenceInput"],
            values["referenceOutput"],
            values["watts"],
            values["kwhPrice"],
        )
        await self.hub.store.set_price(price)
        self.hub.accounting.forget_limits()
        await req.resp.json(200, price.as_json(), NO_STORE)

    async def unset_price(self, req: Request) -> None:
        """``DELETE /api/hub/prices/{model}``: the model costs 0 from now on."""
        model = req.params["model"]
        if not await self.hub.store.delete_price(model):
            raise HTTPError(404, f"the model {model!r} has no price", "unknown_model")
        self.hub.accounting.forget_limits()
        await req.resp.json(200, {"model": model, "priced": False}, NO_STORE)

    async def key_budget(self, req: Request) -> None:
        """``POST /api/hub/keys/{name}/budget`` ``{"budgetDaily"?, "budgetMonthly"?,
        "priority"?}``: the key's budgets (null or 0: none) and priority class."""
        name = req.params["name"]
        body = json_object(await req.body(MAX_KEY_BODY))
        budget = _budget(body)
        if not await self.hub.keys.set_budget(name, budget):
            raise HTTPError(404, f"no active API key is named {name!r}", "unknown_key")
        await req.resp.json(200, {"name": name, **budget.as_json()}, NO_STORE)

    async def keys(self, req: Request) -> None:
        """Every API key (never the key itself), with its turns and tokens since the hub started."""
        totals = self.hub.metrics.keys
        budgets = await self.hub.store.key_budgets()
        keys = []
        owners = await self.hub.people.owners()
        who = person(req)
        for found in await self.hub.keys.listing():
            entry = dict(found)
            owner = owners.get((str(entry.get("name")), str(entry.get("createdAt"))))
            if who is not None and who.role != ADMIN and (owner is None or owner[0] != who.sub):
                continue  # a member sees their own keys only
            entry["person"] = None if owner is None else {"sub": owner[0], "email": owner[1]}
            name = str(entry.get("name"))
            kept = totals.get(name)
            entry["used"] = kept.as_json() if kept is not None else None
            limits = entry.get("limits")
            if limits is not None and not isinstance(limits, dict):  # a KeyLimits
                entry["limits"] = {field: getattr(limits, kw, None) for field, kw in LIMITS.items()}
            if not entry.get("revoked"):
                entry.update((budgets.get(name) or KeyBudget()).as_json())
            keys.append(entry)
        await req.resp.json(200, {"keys": keys, "limitsSupported": True}, NO_STORE)

    async def create_key(self, req: Request) -> None:
        """``POST /api/hub/keys`` ``{"name", "project"?, "rpm"?, "tpm"?, "tokensPerDay"?,
        "maxStreams"?}``: 201 with the key, shown this once."""
        body = json_object(await req.body(MAX_KEY_BODY))
        name = body.get("name")
        if not isinstance(name, str) or not name.strip() or len(name) > 200:
            raise HTTPError(400, '"name" must be a non-empty string', "invalid_request")
        project = body.get("project") or DEFAULT_KEY_PROJECT
        if not isinstance(project, str):
            raise HTTPError(400, '"project" must be a string like OWNER/PROJECT', "invalid_request")
        who = person(req)
        if who is not None and who.role != ADMIN:
            allowed = await self.hub.people.projects_of(who.sub)
            if project not in allowed:
                raise HTTPError(
                    403,
                    f"you may make keys for {', '.join(allowed) or 'no project'} only",
                    "project_not_allowed",
                )
        limits: dict[str, int] = {}
        for field, keyword in LIMITS.items():
            value = body.get(field)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise HTTPError(
                    400, f'"{field}" must be a positive integer or null', "invalid_request"
                )
            limits[keyword] = value
        budget = _budget(body)
        try:
            key = await self.hub.keys.create(name, project, **limits)
            await self.hub.keys.set_budget(name, budget)
        except ValueError as err:
            status = 409 if "already exists" in str(err) else 400
            raise HTTPError(status, str(err), "invalid_request") from None
        answer: dict[str, Any] = {"name": name, "project": project, "key": key}
        if who is not None:  # the key carries who made it (sub, email)
            await self.hub.people.own(key, name, who)
            answer["person"] = {"sub": who.sub, "email": who.email}
        answer.update({field: body.get(field) for field in LIMITS if field in body})
        answer.update(budget.as_json())
        await req.resp.json(201, answer, NO_STORE)

    async def revoke_key(self, req: Request) -> None:
        """``DELETE /api/hub/keys/{name}`` or ``POST /api/hub/keys/revoke`` ``{"name"}``."""
        name = req.params.get("name")
        if name is None:
            body = json_object(await req.body(MAX_KEY_BODY))
            name = body.get("name")
            if not isinstance(name, str) or not name:
                raise HTTPError(400, '"name" must be a non-empty string', "invalid_request")
        who = person(req)
        if (
            who is not None
            and who.role != ADMIN
            and await self.hub.people.owner_of(name) != who.sub
        ):
            raise HTTPError(404, f"you have no active API key named {name!r}", "unknown_key")
        if not await self.hub.keys.revoke(name):
            raise HTTPError(404, f"no active API key is named {name!r}", "unknown_key")
        await req.resp.json(200, {"name": name, "revoked": True}, NO_STORE)

    async def revoke_runner(self, req: Request) -> None:
        """``DELETE /api/hub/runners/{id or name}`` or ``POST /api/hub/runners/revoke``
        ``{"runner"}``: the registration refused from now on, its jobs ended, its channels
        closed (its sessions move to another runner)."""
        which = req.params.get("runner")
        if which is None:
            body = json_object(await req.body(MAX_KEY_BODY))
            which = body.get("runner")
            if not isinstance(which, str) or not which:
                raise HTTPError(400, '"runner" must be a runner\'s id or name', "invalid_request")
        try:
            found = await self.hub.runner_admin.revoke(which)
        except RunnerNotFound as exc:
            raise HTTPError(404, str(exc), "unknown_runner") from None
        answer = {"id": found.id, "name": found.name, "revoked": True}
        await req.resp.json(200, answer, NO_STORE)

    async def enrollments(self, req: Request) -> None:
        """``GET /api/hub/enrollments``: every enrollment token (never the token itself)."""
        found = [e.as_json() for e in await self.hub.store.list_enrollments()]
        await req.resp.json(200, {"enrollments": found}, NO_STORE)

    async def create_enrollment(self, req: Request) -> None:
        """``POST /api/hub/enrollments`` ``{"project", "expiresIn"? (s), "uses"?}``: 201 with
        the token, shown this once."""
        body = json_object(await req.body(MAX_KEY_BODY))
        project = body.get("project")
        if not isinstance(project, str):
            raise HTTPError(400, '"project" must be a string like OWNER/PROJECT', "invalid_request")
        expires, uses = body.get("expiresIn"), body.get("uses")
        if expires is not None and (
            not isinstance(expires, int | float) or isinstance(expires, bool) or expires <= 0
        ):
            raise HTTPError(
                400, '"expiresIn" must be a positive number of seconds', "invalid_request"
            )
        if uses is not None and (not isinstance(uses, int) or isinstance(uses, bool) or uses < 1):
            raise HTTPError(400, '"uses" must be a positive integer or null', "invalid_request")
        try:
            found, token = await self.hub.runner_admin.enroll(project, expires, uses)
        except ValueError as err:
            raise HTTPError(400, str(err), "invalid_request") from None
        await req.resp.json(201, {**found.as_json(), "token": token}, NO_STORE)

    async def revoke_enrollment(self, req: Request) -> None:
        """``DELETE /api/hub/enrollments/{id}``: it registers no runner from now on (runners it
        registered keep their registrations: revoke them as runners)."""
        found = req.params["id"]
        if not await self.hub.store.revoke_enrollment(found):
            raise HTTPError(404, f"no active enrollment token has the id {found!r}", "unknown")
        await req.resp.json(200, {"id": found, "revoked": True}, NO_STORE)

    async def people(self, req: Request) -> None:
        """``GET /api/hub/people``: everyone who signed in, their role and active keys."""
        await req.resp.json(200, {"people": await self.hub.people.listing()}, NO_STORE)

    async def set_person_projects(self, req: Request) -> None:
        """``PUT /api/hub/people/{sub}/projects`` ``{"projects": ["OWNER/PROJECT", ...] | null}``:
        the projects that person may make keys for (null: ``--oidc-member-projects``)."""
        sub = req.params["sub"]
        body = json_object(await req.body(MAX_KEY_BODY))
        projects = body.get("projects")
        if projects is not None:
            if not isinstance(projects, list) or len(projects) > 100:
                raise HTTPError(400, '"projects" must be a list or null', "invalid_request")
            try:
                projects = list(dict.fromkeys("/".join(split_project(p)) for p in projects))
            except (TypeError, ValueError, AttributeError):
                raise HTTPError(
                    400, '"projects" must name projects like OWNER/PROJECT', "invalid_request"
                ) from None
        if not await self.hub.people.set_projects(sub, projects):
            raise HTTPError(404, f"no one with sub {sub!r} has signed in", "unknown_person")
        await req.resp.json(200, {"sub": sub, "projects": projects}, NO_STORE)


def _budget(body: dict[str, Any]) -> KeyBudget:
    """The budgets and priority a key's JSON body gives (HTTPError 400 on a bad one)."""
    priority = body.get("priority")
    if priority is not None and not isinstance(priority, str):
        raise HTTPError(400, '"priority" must be a string', "invalid_request")
    try:
        return budget_of(body.get("budgetDaily"), body.get("budgetMonthly"), priority)
    except ValueError as err:
        raise HTTPError(400, str(err), "invalid_request") from None


def cost_totals(rows: list[HourlyUsage]) -> dict[str, Any]:
    """The rows' cost (and reference cost) per key, per model and in total."""
    per_key: dict[str, list[float]] = {}
    per_model: dict[str, list[float]] = {}
    for row in rows:
        for table, name in ((per_key, row.key_name), (per_model, row.model or "")):
            pair = table.setdefault(name, [0.0, 0.0])
            pair[0] += row.cost
            pair[1] += row.ref_cost

    def listed(table: dict[str, list[float]]) -> dict[str, dict[str, float]]:
        return {n: {"cost": c, "referenceCost": r} for n, (c, r) in table.items()}

    return {
        "perKey": listed(per_key),  # a person's (once keys have one) is a column to add here
        "perModel": listed(per_model),
        "total": sum(row.cost for row in rows),
        "referenceTotal": sum(row.ref_cost for row in rows),
    }
