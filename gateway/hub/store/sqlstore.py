"""The store's methods as the shared operations (``ops``, ``trust_ops``, ``usage_ops``), one
set for both databases: each method makes its operation in the backend's ``dialect`` and hands
it to the backend's ``_run`` (SQLite: on its connection; PostgreSQL: on its pool). The usage
reads write the queued rows first."""

from __future__ import annotations

import abc
from typing import Any

from gateway.hub.money import KeyBudget, Price
from gateway.hub.store import ops, trust_ops, usage_ops
from gateway.hub.store.base import Store
from gateway.hub.store.records import (
    DEFAULT_KEY_PROJECT,
    ApiKey,
    Enrollment,
    HourlyUsage,
    KeyLimits,
    ModelList,
    Registration,
    RunnerRecord,
    StoredJob,
    StoredSession,
    UsageTotal,
)
from gateway.hub.store.sql import Op, SqlDialect, T


class SqlStore(Store):
    """A store whose methods run the shared operations: a backend says its ``dialect`` and
    how it runs an operation (``_run``)."""

    dialect: SqlDialect

    @abc.abstractmethod
    async def _run(self, op: Op[T]) -> T:
        """``op`` run to its end on the backend's database; its answer."""

    async def journal_mark(self, name: str) -> int:
        return await self._run(usage_ops.journal_mark(self.dialect, name))

    # -- jobs --------------------------------------------------------------------------------

    async def save_job(self, job: StoredJob) -> None:
        await self._run(ops.save_job(self.dialect, job))

    async def delete_job(self, job_id: str) -> None:
        await self._run(ops.delete_job(self.dialect, job_id))

    async def add_job_report(self, job_id: str, body: dict[str, Any]) -> None:
        await self._run(ops.add_job_report(self.dialect, job_id, body))

    async def load_jobs(self, *, live_only: bool = False) -> list[StoredJob]:
        return await self._run(ops.load_jobs(self.dialect, live_only))

    async def load_job(self, job_id: str) -> StoredJob | None:
        return await self._run(ops.load_job(self.dialect, job_id))

    async def job_ids(self) -> list[str]:
        return await self._run(ops.job_ids(self.dialect))

    async def count_jobs(self) -> int:
        return await self._run(ops.count_jobs(self.dialect))

    # -- sessions and model lists --------------------------------------------------------------

    async def save_session(self, session: StoredSession) -> None:
        await self._run(ops.save_session(self.dialect, session))

    async def delete_session(
        self, key_name: str, session_id: str, job_id: str | None = None
    ) -> None:
        await self._run(ops.delete_session(self.dialect, key_name, session_id, job_id))

    async def load_sessions(self) -> list[StoredSession]:
        return await self._run(ops.load_sessions(self.dialect))

    async def save_models(self, models: ModelList) -> None:
        await self._run(ops.save_models(self.dialect, models))

    async def load_models(self, owner: str, project: str) -> list[ModelList]:
        return await self._run(ops.load_models(self.dialect, owner, project))

    # -- registrations and API keys -------------------------------------------------------------

    async def add_registration(
        self,
        owner: str,
        project: str,
        name: str,
        labels: list[str],
        enrollment: str | None = None,
    ) -> tuple[Registration, str]:
        return await self._run(
            ops.add_registration(self.dialect, owner, project, name, labels, enrollment)
        )

    async def registration_by_token(self, token: str) -> Registration | None:
        return await self._run(ops.registration_by_token(self.dialect, token))

    async def registration(self, runner_id: str) -> Registration | None:
        return await self._run(ops.registration(self.dialect, runner_id))

    async def list_runners(self) -> list[RunnerRecord]:
        return await self._run(trust_ops.list_runners(self.dialect))

    async def revoke_runner(self, runner_id: str) -> bool:
        return await self._run(trust_ops.revoke_runner(self.dialect, runner_id))

    async def revoked_runners(self) -> set[str]:
        return await self._run(trust_ops.revoked_runners(self.dialect))

    async def runners_seen(self, runner_ids: list[str], at: float) -> None:
        await self._run(trust_ops.runners_seen(self.dialect, runner_ids, at))

    async def create_enrollment(
        self, project: str, expires_at: float | None, uses: int | None
    ) -> tuple[Enrollment, str]:
        return await self._run(trust_ops.create_enrollment(self.dialect, project, expires_at, uses))

    async def list_enrollments(self) -> list[Enrollment]:
        return await self._run(trust_ops.list_enrollments(self.dialect))

    async def enrollment_by_token(self, token: str) -> Enrollment | None:
        return await self._run(trust_ops.enrollment_by_token(self.dialect, token))

    async def use_enrollment(self, enrollment_id: str, now: float) -> bool:
        return await self._run(trust_ops.use_enrollment(self.dialect, enrollment_id, now))

    async def revoke_enrollment(self, enrollment_id: str) -> bool:
        return await self._run(trust_ops.revoke_enrollment(self.dialect, enrollment_id))

    async def create_api_key(
        self, name: str, project: str = DEFAULT_KEY_PROJECT, limits: KeyLimits | None = None
    ) -> str:
        return await self._run(ops.create_api_key(self.dialect, name, project, limits))

    async def list_api_keys(self) -> list[dict[str, object]]:
        return await self._run(ops.list_api_keys(self.dialect))

    async def key_limits(self, name: str) -> tuple[str, KeyLimits] | None:
        return await self._run(ops.key_limits(self.dialect, name))

    async def set_key_limits(self, name: str, limits: KeyLimits) -> bool:
        return await self._run(ops.set_key_limits(self.dialect, name, limits))

    async def revoke_api_key(self, name: str) -> bool:
        return await self._run(ops.revoke_api_key(self.dialect, name))

    async def check_api_key(self, key: str) -> ApiKey | None:
        return await self._run(ops.check_api_key(self.dialect, key))

    async def active_key_ids(self) -> set[str]:
        return await self._run(ops.active_key_ids(self.dialect))

    async def active_key_id(self, name: str) -> str | None:
        return await self._run(ops.active_key_id(self.dialect, name))

    # -- usage (the queued rows written first) ---------------------------------------------------

    async def prune_usage(self, before: float, limit: int) -> int:
        await self.flush_usage()
        return await self._run(usage_ops.prune_usage(self.dialect, before, limit))

    async def usage_turns_from(self) -> float:
        await self.flush_usage()
        return await self._run(usage_ops.usage_turns_from(self.dialect))

    async def usage_rows(
        self, since: float = 0.0, key_name: str | None = None
    ) -> list[dict[str, Any]]:
        await self.flush_usage()
        return await self._run(usage_ops.usage_rows(self.dialect, since, key_name))

    async def hourly_usage(self, since: float, key_name: str | None = None) -> list[HourlyUsage]:
        await self.flush_usage()
        return await self._run(usage_ops.hourly_usage(self.dialect, since, key_name))

    async def usage_totals(
        self, since: float, key_name: str | None = None
    ) -> tuple[list[UsageTotal], bool]:
        await self.flush_usage()
        return await self._run(usage_ops.usage_totals(self.dialect, since, key_name))

    async def tokens_since(self, key_id: str, hour: int) -> int:
        await self.flush_usage()
        return await self._run(usage_ops.tokens_since(self.dialect, key_id, hour))

    async def cost_since(self, key_id: str, hour: int) -> float:
        await self.flush_usage()
        return await self._run(usage_ops.cost_since(self.dialect, key_id, hour))

    async def throughput(self, model: str, since: float) -> tuple[float, float]:
        await self.flush_usage()
        return await self._run(usage_ops.throughput(self.dialect, model, since))

    # -- prices and budgets ----------------------------------------------------------------------

    async def set_price(self, price: Price) -> None:
        await self._run(usage_ops.set_price(self.dialect, price))

    async def delete_price(self, model: str) -> bool:
        return await self._run(usage_ops.delete_price(self.dialect, model))

    async def list_prices(self) -> list[Price]:
        return await self._run(usage_ops.list_prices(self.dialect))

    async def key_budgets(self) -> dict[str, KeyBudget]:
        return await self._run(usage_ops.key_budgets(self.dialect))

    async def set_key_budget(self, name: str, budget: KeyBudget) -> bool:
        return await self._run(usage_ops.set_key_budget(self.dialect, name, budget))
