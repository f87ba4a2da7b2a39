/* Whether work outside the job crowds its members off the CPUs: the decision the waits make
 * after a long sched_yield (step.c), kept apart from the clock and /proc so it is tested alone. */
#ifndef JL_CROWDING_H
#define JL_CROWDING_H

/* The runnable count in the text of /proc/loadavg ("0.52 0.58 0.59 3/412 12345": 3), or -1
 * when the text does not have that form. */
int jl_runnable_in_loadavg(const char *text);

/* With more members than CPUs: runnable tasks (the reader among them) minus the members that
 * may be runnable (members - asleep) fill every CPU. 0 with a CPU per member, or runnable < 0. */
int jl_outside_work_fills_the_cpus(int members, int asleep, int cpus, int runnable);

#endif
