"""The replicas' tables on one PostgreSQL store (migrations 5, 8, 9 and 10, PostgreSQL only), kept
with the store's other migrations: the replicas and their heartbeats, where each job's channel is, the runners' presence, the turns in
flight and of the last minute per API key (its limits), and the admission function.

Pure data: ``schema.MIGRATIONS`` runs these statements on PostgreSQL (SQLite's single hub has no
team: it records the version and nothing else). Every time here is the database server's clock
(``clock_timestamp()`` as Unix seconds), so replicas on machines whose clocks differ agree.

``alp_admit`` is a key's admission in one transaction and one round trip: the key's row locked
(``FOR UPDATE``: admissions of one key run one at a time, whatever replica they reach), its
limits checked against the turns of the last minute and those in flight on live replicas, the
session cap (the key's least recently used idle session evicted when it is reached), then the
turn counted. Its answer: a verdict (``ok`` or the limit passed), the seconds to wait, the
figures a refusal names, the session's stored job, and the session evicted (if one was).
"""

from __future__ import annotations

import re

NOW = "extract(epoch FROM clock_timestamp())"  # the database's clock, Unix seconds

TABLES = (
    """CREATE TABLE IF NOT EXISTS replicas (
    id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    version TEXT NOT NULL,
    started_at DOUBLE PRECISION NOT NULL,
    heartbeat_at DOUBLE PRECISION NOT NULL,
    stopped BOOLEAN NOT NULL DEFAULT false
)""",
    """CREATE TABLE IF NOT EXISTS channels (
    job_id TEXT PRIMARY KEY,
    replica TEXT NOT NULL,
    runner_id TEXT NOT NULL,
    opened_at DOUBLE PRECISION NOT NULL
)""",
    "CREATE INDEX IF NOT EXISTS channels_replica ON channels (replica)",
    """CREATE TABLE IF NOT EXISTS runner_presence (
    runner_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    project TEXT NOT NULL,
    name TEXT,
    labels TEXT NOT NULL DEFAULT '[]',
    seen_at DOUBLE PRECISION NOT NULL,
    capabilities TEXT,
    polled_at DOUBLE PRECISION
)""",
    """CREATE TABLE IF NOT EXISTS suspended_requests (
    job_id TEXT NOT NULL,
    request_id TEXT NOT NULL,
    replica TEXT NOT NULL,
    frames BIGINT NOT NULL,
    since DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (job_id, request_id)
)""",
    """CREATE TABLE IF NOT EXISTS team_keys (
    key_id TEXT PRIMARY KEY,
    day BIGINT NOT NULL DEFAULT -1,
    day_tokens BIGINT NOT NULL DEFAULT 0
)""",
    """CREATE TABLE IF NOT EXISTS team_turns (
    id TEXT PRIMARY KEY,
    key_id TEXT NOT NULL,
    session TEXT NOT NULL,
    replica TEXT NOT NULL,
    admitted_at DOUBLE PRECISION NOT NULL,
    reserved BIGINT NOT NULL,
    tokens BIGINT,
    ended_at DOUBLE PRECISION
)""",
    "CREATE INDEX IF NOT EXISTS team_turns_key ON team_turns (key_id, admitted_at)",
    "CREATE INDEX IF NOT EXISTS team_turns_flight ON team_turns (replica) WHERE ended_at IS NULL",
    "ALTER TABLE jobs ADD COLUMN IF NOT EXISTS replica TEXT",
    "ALTER TABLE jobs ADD COLUMN IF NOT EXISTS offered_to TEXT",
    "ALTER TABLE sessions ADD COLUMN IF NOT EXISTS last_used DOUBLE PRECISION NOT NULL DEFAULT 0",
)

ADMIT = f"""CREATE OR REPLACE FUNCTION alp_admit(
    p_turn TEXT, p_key TEXT, p_key_name TEXT, p_session TEXT, p_replica TEXT,
    p_reserved BIGINT, p_rpm BIGINT, p_tpm BIGINT, p_tpd BIGINT, p_streams BIGINT,
    p_sessions BIGINT, p_expiry DOUBLE PRECISION)
RETURNS TABLE (verdict TEXT, wait DOUBLE PRECISION, used BIGINT, held BIGINT, job TEXT,
    evicted_session TEXT, evicted_job TEXT)
LANGUAGE plpgsql AS $$
DECLARE
    now_ DOUBLE PRECISION := {NOW};
    today BIGINT := (floor(now_ / 86400) * 86400)::BIGINT;
    live TEXT[];
    k team_keys%ROWTYPE;
    flying BIGINT;
    reserved_ BIGINT;
    n BIGINT;
    t DOUBLE PRECISION;
    job_ TEXT;
    ev_session TEXT;
    ev_job TEXT;
BEGIN
    SELECT array_agg(id) INTO live FROM replicas
        WHERE heartbeat_at > now_ - p_expiry AND NOT stopped;
    live := array_append(COALESCE(live, '{{}}'::TEXT[]), p_replica);
    INSERT INTO team_keys (key_id) VALUES (p_key) ON CONFLICT DO NOTHING;
    SELECT * INTO k FROM team_keys WHERE key_id = p_key FOR UPDATE;
    DELETE FROM team_turns WHERE key_id = p_key AND ended_at < now_ - 60
        AND admitted_at < now_ - 60;
    -- the turns a replica that stopped beating left in flight: ended (their tokens unknown)
    UPDATE team_turns SET ended_at = now_, tokens = 0
        WHERE key_id = p_key AND ended_at IS NULL AND NOT (replica = ANY(live));
    SELECT COALESCE(SUM(reserved), 0)::BIGINT, COUNT(*) INTO reserved_, flying
        FROM team_turns WHERE key_id = p_key AND ended_at IS NULL;
    IF p_tpd IS NOT NULL THEN
        IF k.day <> today THEN
            k.day_tokens := COALESCE((SELECT SUM(prompt_tokens + completion_tokens)
                FROM usage_hourly WHERE key_id = p_key AND hour >= today), 0);
            k.day := today;
            UPDATE team_keys SET day = today, day_tokens = k.day_tokens WHERE key_id = p_key;
        END IF;
        IF k.day_tokens + reserved_ >= p_tpd THEN
            RETURN QUERY SELECT 'tokens_per_day'::TEXT, today + 86400 - now_, k.day_tokens,
                reserved_, NULL::TEXT, NULL::TEXT, NULL::TEXT;
            RETURN;
        END IF;
    END IF;
    IF p_tpm IS NOT NULL THEN
        SELECT COALESCE(SUM(tokens), 0)::BIGINT INTO n FROM team_turns
            WHERE key_id = p_key AND ended_at > now_ - 60;
        IF n + reserved_ >= p_tpm THEN
            SELECT w.e INTO t FROM (SELECT ended_at AS e,
                SUM(tokens) OVER (ORDER BY ended_at, id) AS gone FROM team_turns
                WHERE key_id = p_key AND ended_at > now_ - 60) w
                WHERE n + reserved_ - w.gone < p_tpm ORDER BY w.e LIMIT 1;
            RETURN QUERY SELECT 'tpm'::TEXT, COALESCE(t + 60 - now_, 0), n, reserved_,
                NULL::TEXT, NULL::TEXT, NULL::TEXT;
            RETURN;
        END IF;
    END IF;
    IF p_rpm IS NOT NULL THEN
        SELECT COUNT(*) INTO n FROM team_turns WHERE key_id = p_key AND admitted_at > now_ - 60;
        IF n >= p_rpm THEN
            SELECT admitted_at INTO t FROM team_turns
                WHERE key_id = p_key AND admitted_at > now_ - 60
                ORDER BY admitted_at DESC OFFSET p_rpm - 1 LIMIT 1;
            RETURN QUERY SELECT 'rpm'::TEXT, COALESCE(t + 60 - now_, 0), n, 0::BIGINT,
                NULL::TEXT, NULL::TEXT, NULL::TEXT;
            RETURN;
        END IF;
    END IF;
    IF p_streams IS NOT NULL AND flying >= p_streams THEN
        RETURN QUERY SELECT 'max_streams'::TEXT, 1::DOUBLE PRECISION, flying, 0::BIGINT,
            NULL::TEXT, NULL::TEXT, NULL::TEXT;
        RETURN;
    END IF;
    SELECT s.job_id INTO job_ FROM sessions s
        WHERE s.key_name = p_key_name AND s.session_id = p_session AND s.key_id = p_key;
    IF p_sessions > 0 AND NOT FOUND AND NOT EXISTS (SELECT 1 FROM team_turns
            WHERE key_id = p_key AND session = p_session AND ended_at IS NULL) THEN
        SELECT COUNT(*) INTO n FROM (SELECT session_id FROM sessions WHERE key_id = p_key
            UNION SELECT session FROM team_turns WHERE key_id = p_key AND ended_at IS NULL) h;
        IF n >= p_sessions THEN
            SELECT s.session_id, s.job_id INTO ev_session, ev_job FROM sessions s
                WHERE s.key_id = p_key AND NOT EXISTS (SELECT 1 FROM team_turns f
                    WHERE f.key_id = p_key AND f.session = s.session_id AND f.ended_at IS NULL)
                ORDER BY s.last_used, s.session_id LIMIT 1;
            IF NOT FOUND THEN
                RETURN QUERY SELECT 'max_sessions'::TEXT, 1::DOUBLE PRECISION, n, 0::BIGINT,
                    NULL::TEXT, NULL::TEXT, NULL::TEXT;
                RETURN;
            END IF;
            DELETE FROM sessions WHERE key_id = p_key AND session_id = ev_session;
        END IF;
    END IF;
    INSERT INTO team_turns (id, key_id, session, replica, admitted_at, reserved)
        VALUES (p_turn, p_key, p_session, p_replica, now_, p_reserved);
    RETURN QUERY SELECT 'ok'::TEXT, 0::DOUBLE PRECISION, 0::BIGINT, 0::BIGINT, job_,
        ev_session, ev_job;
END
$$"""

STATEMENTS = (*TABLES, ADMIT)

# migration 8: a team's budgets in money, admitted in the same transaction as the limits above
# (``alp_admit_budget`` checks the key's spend of the UTC day and month and what its turns in
# flight hold, then runs ``alp_admit`` and marks the turn's reservation); a turn's cost is added
# at its release, as its tokens are
MONTH = "extract(epoch FROM date_trunc('month', to_timestamp({t}) AT TIME ZONE 'UTC'))::BIGINT"
NEXT_MONTH = (
    "extract(epoch FROM date_trunc('month', to_timestamp({t}) AT TIME ZONE 'UTC')"
    " + interval '1 month')::BIGINT"
)

ADMIT_BUDGET = f"""CREATE OR REPLACE FUNCTION alp_admit_budget(
    p_turn TEXT, p_key TEXT, p_key_name TEXT, p_session TEXT, p_replica TEXT,
    p_reserved BIGINT, p_rpm BIGINT, p_tpm BIGINT, p_tpd BIGINT, p_streams BIGINT,
    p_sessions BIGINT, p_expiry DOUBLE PRECISION,
    p_cost DOUBLE PRECISION, p_daily DOUBLE PRECISION, p_monthly DOUBLE PRECISION)
RETURNS TABLE (verdict TEXT, wait DOUBLE PRECISION, used BIGINT, held BIGINT, job TEXT,
    evicted_session TEXT, evicted_job TEXT, spent DOUBLE PRECISION, holding DOUBLE PRECISION)
LANGUAGE plpgsql AS $$
DECLARE
    now_ DOUBLE PRECISION := {NOW};
    today BIGINT := (floor(now_ / 86400) * 86400)::BIGINT;
    month_ BIGINT := {MONTH.format(t="now_")};
    next_ BIGINT := {NEXT_MONTH.format(t="now_")};
    live TEXT[];
    k team_keys%ROWTYPE;
    held_ DOUBLE PRECISION;
BEGIN
    IF p_daily IS NOT NULL OR p_monthly IS NOT NULL THEN
        INSERT INTO team_keys (key_id) VALUES (p_key) ON CONFLICT DO NOTHING;
        SELECT * INTO k FROM team_keys WHERE key_id = p_key FOR UPDATE;
        SELECT array_agg(id) INTO live FROM replicas
            WHERE heartbeat_at > now_ - p_expiry AND NOT stopped;
        live := array_append(COALESCE(live, '{{}}'::TEXT[]), p_replica);
        SELECT COALESCE(SUM(reserved_cost), 0) INTO held_ FROM team_turns
            WHERE key_id = p_key AND ended_at IS NULL AND replica = ANY(live);
        IF p_daily IS NOT NULL THEN
            IF k.cost_day <> today THEN
                k.day_cost := COALESCE((SELECT SUM(cost) FROM usage_hourly
                    WHERE key_id = p_key AND hour >= today), 0);
                k.cost_day := today;
                UPDATE team_keys SET cost_day = today, day_cost = k.day_cost
                    WHERE key_id = p_key;
            END IF;
            IF k.day_cost + held_ >= p_daily THEN
                RETURN QUERY SELECT 'budget_daily'::TEXT, today + 86400 - now_, 0::BIGINT,
                    0::BIGINT, NULL::TEXT, NULL::TEXT, NULL::TEXT, k.day_cost, held_;
                RETURN;
            END IF;
        END IF;
        IF p_monthly IS NOT NULL THEN
            IF k.cost_month <> month_ THEN
                k.month_cost := COALESCE((SELECT SUM(cost) FROM usage_hourly
                    WHERE key_id = p_key AND hour >= month_), 0);
                k.cost_month := month_;
                UPDATE team_keys SET cost_month = month_, month_cost = k.month_cost
                    WHERE key_id = p_key;
            END IF;
            IF k.month_cost + held_ >= p_monthly THEN
                RETURN QUERY SELECT 'budget_monthly'::TEXT, next_ - now_, 0::BIGINT,
                    0::BIGINT, NULL::TEXT, NULL::TEXT, NULL::TEXT, k.month_cost, held_;
                RETURN;
            END IF;
        END IF;
    END IF;
    RETURN QUERY SELECT a.verdict, a.wait, a.used, a.held, a.job, a.evicted_session,
        a.evicted_job, 0::DOUBLE PRECISION, 0::DOUBLE PRECISION
        FROM alp_admit(p_turn, p_key, p_key_name, p_session, p_replica, p_reserved, p_rpm,
            p_tpm, p_tpd, p_streams, p_sessions, p_expiry) a;
    UPDATE team_turns SET reserved_cost = p_cost WHERE id = p_turn;
END
$$"""

BUDGET_STATEMENTS = (
    "ALTER TABLE team_keys ADD COLUMN IF NOT EXISTS cost_day BIGINT NOT NULL DEFAULT -1",
    "ALTER TABLE team_keys ADD COLUMN IF NOT EXISTS day_cost DOUBLE PRECISION NOT NULL DEFAULT 0",
    "ALTER TABLE team_keys ADD COLUMN IF NOT EXISTS cost_month BIGINT NOT NULL DEFAULT -1",
    "ALTER TABLE team_keys ADD COLUMN IF NOT EXISTS month_cost DOUBLE PRECISION NOT NULL DEFAULT 0",
    "ALTER TABLE team_turns ADD COLUMN IF NOT EXISTS reserved_cost DOUBLE PRECISION NOT NULL"
    " DEFAULT 0",
    ADMIT_BUDGET,
)

# migration 9: each turn's usage row as it would be were it cut now, kept from its admission
# (``alp_admit_recorded``: the admission, then the record, one round trip) until the row is in
# the ledger, by its replica as the turn ends or by a survivor when that replica is dead
RECORDED: tuple[str, ...] = (
    "ALTER TABLE team_turns ADD COLUMN IF NOT EXISTS record TEXT",
    "CREATE INDEX IF NOT EXISTS team_turns_unsettled ON team_turns (replica)"
    " WHERE record IS NOT NULL",
    """CREATE OR REPLACE FUNCTION alp_admit_recorded(p_record TEXT,
    p_turn TEXT, p_key TEXT, p_key_name TEXT, p_session TEXT, p_replica TEXT,
    p_reserved BIGINT, p_rpm BIGINT, p_tpm BIGINT, p_tpd BIGINT, p_streams BIGINT,
    p_sessions BIGINT, p_expiry DOUBLE PRECISION)
RETURNS TABLE (verdict TEXT, wait DOUBLE PRECISION, used BIGINT, held BIGINT, job TEXT,
    evicted_session TEXT, evicted_job TEXT)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY SELECT * FROM alp_admit(p_turn, p_key, p_key_name, p_session, p_replica,
        p_reserved, p_rpm, p_tpm, p_tpd, p_streams, p_sessions, p_expiry);
    UPDATE team_turns SET record = p_record WHERE id = p_turn;  -- admitted: its row is there
END
$$""",
)

# both: a turn with a budget and a record (migration 9 comes after 8, so alp_admit_budget is there)
ADMIT_BUDGET_RECORDED = """CREATE OR REPLACE FUNCTION alp_admit_budget_recorded(p_record TEXT,
    p_turn TEXT, p_key TEXT, p_key_name TEXT, p_session TEXT, p_replica TEXT,
    p_reserved BIGINT, p_rpm BIGINT, p_tpm BIGINT, p_tpd BIGINT, p_streams BIGINT,
    p_sessions BIGINT, p_expiry DOUBLE PRECISION,
    p_cost DOUBLE PRECISION, p_daily DOUBLE PRECISION, p_monthly DOUBLE PRECISION)
RETURNS TABLE (verdict TEXT, wait DOUBLE PRECISION, used BIGINT, held BIGINT, job TEXT,
    evicted_session TEXT, evicted_job TEXT, spent DOUBLE PRECISION, holding DOUBLE PRECISION)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY SELECT * FROM alp_admit_budget(p_turn, p_key, p_key_name, p_session,
        p_replica, p_reserved, p_rpm, p_tpm, p_tpd, p_streams, p_sessions, p_expiry, p_cost,
        p_daily, p_monthly);
    UPDATE team_turns SET record = p_record WHERE id = p_turn;  -- admitted: its row is there
END
$$"""
RECORDED = (*RECORDED, ADMIT_BUDGET_RECORDED)


def _admit_call(budget: bool, record: bool) -> str:
    """How a replica calls for an admission: ``alp_admit``, or ``alp_admit_budget`` (the key's
    budgets first), each ``_recorded`` when the turn's record is kept with it (its first
    parameter)."""
    types = ["$1", "$2", "$3", "$4", "$5", *(f"${n}::int8" for n in range(6, 12)), "$12::float8"]
    columns = "verdict, wait, used, held, job, evicted_session, evicted_job"
    function = "alp_admit"
    if budget:
        types += ["$13::float8", "$14::float8", "$15::float8"]
        columns += ", spent, holding"
        function += "_budget"
    if record:
        types = ["$1", *(re.sub(r"\$(\d+)", lambda m: f"${int(m[1]) + 1}", t) for t in types)]
        function += "_recorded"
    return f"SELECT {columns} FROM {function}({', '.join(types)})"


# (budget given, record given) -> the statement
ADMIT_CALLS = {(b, r): _admit_call(b, r) for b in (False, True) for r in (False, True)}

# migration 10: a runner's clean stop (its last poll's ``stopping``) in its presence, so that
# every replica counts it down at once, not only the one it polled
STOPPED = (
    "ALTER TABLE runner_presence ADD COLUMN IF NOT EXISTS stopped BOOLEAN NOT NULL DEFAULT false",
)
