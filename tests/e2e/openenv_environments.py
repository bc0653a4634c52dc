"""The environments of tests/e2e/test_openenv_runs.py: the echo server of
tests/fixtures/openenv_echo_server.py as our environment, at the address the test put in
E2E_OPENENV_URL (loaded by dotted path `openenv_environments.Echo`)."""

import os

from aligner_ext.agents.openenv_environment import OpenEnvEnvironment


class Echo(OpenEnvEnvironment):
    OBSERVATION_FIELD = "echoed_message"
    MESSAGE_TIMEOUT_S = 2.0  # the `hang` message: the server never answers

    def __init__(self):
        self.BASE_URL = os.environ["E2E_OPENENV_URL"]
        super().__init__()
