"""Agreement among the ranks of a socket backend: which ranks continue after a failure
(membership: coordinator, quorum, epochs), the loop that shrinks a group and forms the next one
(shrinking), and the invitation of newcomers that grows it (enrolment). Used by the ring and
JACCL backends; built on the transports below, never on a backend."""
