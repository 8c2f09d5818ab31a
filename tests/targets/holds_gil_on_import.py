"""A module whose import keeps the GIL in a C call for as long as ``HOLD_S`` says (hung.py's gil_import
mode): a stand-in for a start-up import that compiles or initialises for seconds."""

import ctypes
import os

ctypes.PyDLL(None).sleep(int(os.environ.get("HOLD_S", "3600")))  # STATE:import
