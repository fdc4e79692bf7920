"""Whether ``model.path`` names a model this process can load, answered in seconds and before anything heavy.

A local path must be an HF model directory. A name that could be a Hugging Face hub id and is no local directory
is asked of the hub once (``probe_hub``), or looked up in its cache when the hub cannot be reached. Imports
nothing but the standard library (``huggingface_hub`` inside ``probe_hub``): ``posttrain <recipe>`` runs it before
it imports torch and transformers (``posttrain.cli``), and ``start_run`` before it writes anything.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

# A Hugging Face hub id: ``name`` or ``namespace/name``. Anything else (two slashes, a leading ``.``, ``/`` or ``~``)
# can only be a local path.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
PROBE_TIMEOUT_S = 5.0  # one request to the hub: well under the 10 s a newcomer should wait to learn it is unreachable
_probed: set[str] = set()  # hub ids this process has found loadable


def could_be_hub_id(text: str) -> bool:
    """Whether ``text`` has the shape of a hub id (``name`` or ``namespace/name``); it may still be a local name."""
    return bool(_HUB_ID.fullmatch(text))


def check_model_path(path: str) -> None:
    """One line (``FileNotFoundError``) when ``path`` is no model this process can load: a local path that is no
    model directory, or a name that could be a hub id, is no local directory, and that the hub does not serve or
    that can neither be reached nor found in the local cache (``probe_hub``)."""
    local = Path(path).expanduser()
    if not local.exists() and could_be_hub_id(path):
        probe_hub(path)
        return
    if not (local / "config.json").is_file():
        why = "no config.json in it" if local.is_dir() else f"no such directory under {Path.cwd()}"
        raise FileNotFoundError(f"{path}: not an HF model directory ({why}). Build one with `posttrain model tiny "
                                f"{path}` or point model.path at a saved model.")


def hub_failure(path: str, reason: str) -> FileNotFoundError:
    """The one line for a name that is no local directory and did not load from the hub: it may be either."""
    return FileNotFoundError(f"{path}: no such directory under {Path.cwd()}, and loading it as a Hugging Face hub id "
                             f"failed: {reason}")


def probe_hub(repo_id: str) -> None:
    """Whether transformers can load hub id ``repo_id``, asked once per process, in seconds.

    One request for its ``config.json``, without retries: left to transformers, huggingface_hub retries a download
    that cannot connect five times with backoff, for each of the several files a load asks for (a minute of
    "Retrying in 8s" lines). The hub's answer (no such repo, gated, no ``config.json``) is the failure's reason.
    When the hub cannot be reached, a cached copy is loaded and the process goes offline (``HF_HUB_OFFLINE``), so
    that no later request waits again; with no cached copy the run stops here, before it writes anything.
    """
    if repo_id in _probed:
        return
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError

    cached = isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    if constants.HF_HUB_OFFLINE:
        if not cached:
            raise hub_failure(repo_id, "HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache; "
                              f"download it where there is a network (`hf download {repo_id}`) or point model.path "
                              "at a local directory")
    else:
        try:
            get_hf_file_metadata(hf_hub_url(repo_id, "config.json"), timeout=PROBE_TIMEOUT_S)
        except HfHubHTTPError as exc:  # the hub answered: no such repo, gated, no config.json
            if not cached:
                first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
                raise hub_failure(repo_id, first) from None
        except Exception as exc:  # noqa: BLE001 - no answer at all (refused, DNS, timeout, proxy); httpx's classes vary
            reason = " ".join(str(exc).split()) or type(exc).__name__
            if not cached:
                raise hub_failure(repo_id, f"cannot connect to {constants.ENDPOINT} ({reason}) and it is not in the "
                                  f"local Hugging Face cache; download it where there is a network (`hf download "
                                  f"{repo_id}`) or point model.path at a local directory") from None
            # huggingface_hub and transformers read the flag at each call; child processes read the variable.
            os.environ["HF_HUB_OFFLINE"] = "1"
            constants.HF_HUB_OFFLINE = True
            if int(os.environ.get("RANK", "0")) == 0:  # torchrun's ranks each ask; one says it
                print(f"[posttrain] cannot connect to {constants.ENDPOINT} ({reason}): {repo_id} loads from the cached "
                      "copy, offline (HF_HUB_OFFLINE=1) from here on", file=sys.stderr, flush=True)
    _probed.add(repo_id)
