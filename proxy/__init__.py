"""HTTP side of ctxgate: routes, tenancy, config, forwarding, session state."""
import os

# Importing litellm otherwise fetches a remote model-cost map, with retries, at start.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
