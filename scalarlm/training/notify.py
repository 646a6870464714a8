"""Tell the control plane a step was published (best effort: the file poll of `checkpoints/latest` is the fallback)."""

from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.request
from collections.abc import Mapping

from scalarlm.protocol.training import PublishedNotice

logger = logging.getLogger(__name__)

NOTIFY_URL_ENV = "SCALARLM_NOTIFY_URL"
NOTIFY_KEY_ENV = "SCALARLM_NOTIFY_KEY"
TIMEOUT_S = 2.0


def notify_published(job_id: str, step: int, environ: Mapping[str, str] | None = None) -> bool:
    """POST PublishedNotice to $SCALARLM_NOTIFY_URL/v1/internal/published; True if it was accepted."""
    env = os.environ if environ is None else environ
    base = env.get(NOTIFY_URL_ENV)
    if not base:
        return False
    body = PublishedNotice(job_id=job_id, step=step).model_dump_json().encode()
    headers = {"Content-Type": "application/json"}
    if env.get(NOTIFY_KEY_ENV):
        headers["Authorization"] = f"Bearer {env[NOTIFY_KEY_ENV]}"
    request = urllib.request.Request(base.rstrip("/") + "/v1/internal/published", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            ok = 200 <= response.status < 300
    except (urllib.error.URLError, OSError, ValueError) as e:
        logger.warning("could not notify %s of step %d: %s", base, step, e)
        return False
    if not ok:
        logger.warning("notify of step %d answered %s", step, json.dumps(response.status))
    return ok
