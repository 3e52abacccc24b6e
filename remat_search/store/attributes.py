"""The names a study's and a trial's user attributes go by: what the search writes beside
optuna's own values and constraints, and what the queries and the service read back."""

from __future__ import annotations

import os
import socket
from typing import Literal

# Trial user attributes written by the search.
PLAN_ATTR, MEASUREMENT_ATTR, FAILURE_ATTR = "plan", "measurement", "failure"
HOST_ATTR, PID_ATTR, REUSED_ATTR = "host", "pid", "reused_from"
STARTED_ATTR = "pid_started"
"""When the search process (``PID_ATTR``) started: a pid the system gave to another process
since is told apart by its start time."""
HOST_ENV = "REMAT_SEARCH_HOST"
"""Overrides this host's name in the trials it marks and the claims it holds: two processes of
one machine given two names judge each other's trials as two hosts do, by heartbeat only
(benchmarks/chaos_hosts.py)."""


def host_name() -> str:
    """This host's name as trials (``HOST_ATTR``) and claims record it: ``$REMAT_SEARCH_HOST``,
    else the machine's."""
    return os.environ.get(HOST_ENV) or socket.gethostname()

PREDICTION_ATTR, CACHED_ATTR = "prediction", "cached_from"
SAME_PROGRAM_ATTR = "same_program_as"
"""``study#trial`` that measured the program this trial's plan compiled to: its measurement
stands for this one, which was compiled but not run."""
QUEUED_ATTR = "queued_params"
"""The parameters a queued trial was enqueued with (``study.enqueue_trial(params, user_attrs=
{QUEUED_ATTR: params})``): how the search and the planner tell a queued plan, which optuna
keeps only in a private system attribute, before its parameters are suggested."""
# Study user attributes.
LAYERS_ATTR = "layers"
STACKS_ATTR = "stacks"
"""The layers of each unit the model runs as one body (a scanned stack), where it scans any."""
NO_REMAT_PEAK_ATTR = "no_remat_peak"
"""The compiled peak of the uniform no-remat plan at the study's own batch and mesh, where a
search resolved a share budget (``70%``) against it: what a query's share is taken of, so that
both take it of the same bytes (a study of configurations has no trial of that plan)."""
SPEC_ATTR = "spec"
"""The spec a study was last submitted or searched with, without its storage URL: what a
worker needs to measure it (``search.study.spec_of_submitted``)."""
LABELS_ATTR = "labels"
SETTINGS_ATTR = "settings"
"""How the study's last search measured (``search.study.SETTINGS_FIELDS``): its timing, its
``gradient_tolerance`` (null: the check's measured threshold), …"""
INTERRUPTED = "interrupted"
MOVED = "moved"
"""The failure reason of a queued plan taken at a configuration the workload had refused, and queued
again at the next it takes (``search.admission``): counted for nothing, as an interrupted trial."""
MOVED_TO_ATTR = "moved_to"
"""Where a moved trial's plan was queued again: the configuration's label."""
CONFIRMATION_ATTR = "confirmation"
SETTLED_ATTR = "confirmation_settled"
"""What the latest confirmation raced to a confirmed answer: the budgets it settled, those where
its race budget ran out first (``results.Settlement``)."""
COST_MODEL_ATTR = "cost_model"
"""The planner's cost model as the search last fitted it, with how many complete trials it was
fitted to (``{"complete": n, "model": ...}``): ``plan`` answers from it while the study still
holds that many, instead of reading and fitting every trial again (``search.cost_model``)."""
ANCHOR_ATTR = "anchor_seconds"
"""The study's reference time of the anchor plan, in which its anchored step times are stated."""

TrialStatus = Literal["measured", "over_budget", "failed", "infeasible", "interrupted", "moved", "running", "waiting"]
