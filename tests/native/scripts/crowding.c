/* Checks the decision the waits make after a long sched_yield (csrc/shm/crowding.c): reading the
 * runnable count out of /proc/loadavg's text (and refusing text of another form), and when work
 * outside the job fills the CPUs. Also reads this machine's /proc/loadavg, which must parse.
 * Prints one line per check; exits 1 if any fails. */
#include <stdio.h>

#include "crowding.h"

static int failed;

static void check(int ok, const char *what, int value) {
    printf("%s %s: %d\n", ok ? "ok" : "FAILED", what, value);
    failed |= !ok;
}

int main(void) {
    int n = jl_runnable_in_loadavg("0.52 0.58 0.59 3/412 12345\n");
    check(n == 3, "runnable in a usual line", n);
    n = jl_runnable_in_loadavg("12.00 9.50 4.25 117/2048 99\n");
    check(n == 117, "runnable on a busy host", n);
    n = jl_runnable_in_loadavg("0.52 0.58 0.59\n");
    check(n == -1, "a line without the fourth field", n);
    n = jl_runnable_in_loadavg("0.52 0.58 0.59 x/412 1\n");
    check(n == -1, "a fourth field that is no count", n);
    n = jl_runnable_in_loadavg("0.52 0.58 0.59 3 1\n");
    check(n == -1, "a count without its total", n);
    n = jl_runnable_in_loadavg("");
    check(n == -1, "empty text", n);

    FILE *f = fopen("/proc/loadavg", "r");
    char text[128] = "";
    if (f != NULL) {
        if (fgets(text, sizeof text, f) == NULL)
            text[0] = '\0';
        fclose(f);
    }
    n = jl_runnable_in_loadavg(text);
    check(n >= 1, "this machine's /proc/loadavg (this program is runnable)", n);

    /* members, asleep, cpus, runnable */
    n = jl_outside_work_fills_the_cpus(2, 0, 2, 40);
    check(n == 0, "a CPU per member: never, whatever the load", n);
    n = jl_outside_work_fills_the_cpus(4, 0, 2, 4);
    check(n == 0, "4 members on 2 CPUs, nothing else runnable", n);
    n = jl_outside_work_fills_the_cpus(4, 0, 2, 5);
    check(n == 0, "one outside task: a CPU is left", n);
    n = jl_outside_work_fills_the_cpus(4, 0, 2, 6);
    check(n == 1, "two outside tasks on 2 CPUs", n);
    n = jl_outside_work_fills_the_cpus(4, 3, 2, 3);
    check(n == 1, "three members asleep: the two other runnable tasks are outside", n);
    n = jl_outside_work_fills_the_cpus(8, 2, 2, 7);
    check(n == 0, "8 members, 2 asleep, 7 runnable: one outside task", n);
    n = jl_outside_work_fills_the_cpus(8, 0, 2, -1);
    check(n == 0, "an unreadable count: keep yielding", n);
    return failed;
}
