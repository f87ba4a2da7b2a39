"""Stop in pdb; the test drives the debugger through the launcher's stdin."""
import pdb

secret = 6 * 7
pdb.Pdb(nosigint=True).set_trace()
print("after pdb", flush=True)
