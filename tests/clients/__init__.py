"""Real npm clients against a served gateway: the ``openai`` package and the Vercel AI
SDK (``ai``) with its ``@ai-sdk/openai`` and ``@ai-sdk/openai-compatible`` providers,
pinned in ``node/package-lock.json`` and run through ``node`` (``scripts/test`` runs
``npm ci`` first when ``node/node_modules`` is missing)."""
