"""The stateful property tests I1-I5 (kvpush.testing.ProtocolMachine)."""

from __future__ import annotations

from hypothesis import settings

from kvpush.testing import FaultFreeMachine, ProtocolMachine

TestProtocolWithFaults = ProtocolMachine.TestCase
TestProtocolWithFaults.settings = settings(settings(), stateful_step_count=60)

TestProtocolFaultFree = FaultFreeMachine.TestCase
TestProtocolFaultFree.settings = settings(settings(), stateful_step_count=40)
