/* The OpenMPI side of scripts/bench/collective_vs_mpi.sh: the same ops, sizes and timing rules as
 * `troupe bench collective --csv` (apps/cmd_bench_collective.cpp), on MPI_FLOAT.
 *
 * size = the whole buffer of the op (allreduce, broadcast: the vector; all_gather: the gathered
 * output; reduce_scatter: the input; all_to_all, all_to_allv: one rank's send buffer;
 * all_to_allv with equal splits, as troupe's bench sends them). Per size: one checked
 * run, `warmup` untimed runs, then `reps` repetitions of `iters` runs (iters chosen by rank 0 from
 * one timed run so that all reps take about `seconds`); a repetition's time is the slowest rank's
 * mean; the fastest repetition is printed as op,bytes,time_us,algbw_GBs,busbw_GBs.
 *
 * usage: mpi_allreduce [--ops a,b,...] [--min BYTES] [--max BYTES] [--step K] [--warmup N]
 *                      [--reps N] [--seconds S]
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double bus_factor(const char* op, int n) {
  if (strcmp(op, "allreduce") == 0) return 2.0 * (n - 1) / n;
  if (strcmp(op, "broadcast") == 0) return 1.0;
  return (double)(n - 1) / n;
}

static int cmp_double(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

/* Runs one op on `bytes` bytes; returns MPI_SUCCESS. */
static int run_op(const char* op, float* in, float* out, size_t bytes, int n) {
  const int elems = (int)(bytes / 4), per = (int)(bytes / 4 / (size_t)n);
  if (strcmp(op, "allreduce") == 0)
    return MPI_Allreduce(MPI_IN_PLACE, in, elems, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  if (strcmp(op, "reduce_scatter") == 0)
    return MPI_Reduce_scatter_block(in, out, per, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  if (strcmp(op, "all_gather") == 0)
    return MPI_Allgather(in, per, MPI_FLOAT, out, per, MPI_FLOAT, MPI_COMM_WORLD);
  if (strcmp(op, "broadcast") == 0) return MPI_Bcast(in, elems, MPI_FLOAT, 0, MPI_COMM_WORLD);
  if (strcmp(op, "all_to_all") == 0)
    return MPI_Alltoall(in, per, MPI_FLOAT, out, per, MPI_FLOAT, MPI_COMM_WORLD);
  if (strcmp(op, "all_to_allv") == 0) {
    static int counts[1024], displs[1024];
    for (int j = 0; j < n && j < 1024; ++j) counts[j] = per, displs[j] = j * per;
    return MPI_Alltoallv(in, counts, displs, MPI_FLOAT, out, counts, displs, MPI_FLOAT,
                         MPI_COMM_WORLD);
  }
  return MPI_ERR_OP;
}

static size_t parse_size(const char* s) {
  char* end = NULL;
  double v = strtod(s, &end);
  if (*end == 'K' || *end == 'k') v *= 1024;
  if (*end == 'M' || *end == 'm') v *= 1024 * 1024;
  if (*end == 'G' || *end == 'g') v *= 1024.0 * 1024 * 1024;
  return (size_t)v;
}

int main(int argc, char** argv) {
  char ops_arg[256] = "allreduce,reduce_scatter,all_gather,broadcast,all_to_all,all_to_allv";
  size_t lo = 1024, hi = (size_t)256 << 20;
  int step = 4, warmup = 5, reps = 5;
  double seconds = 0.2;
  MPI_Init(&argc, &argv);
  for (int i = 1; i + 1 < argc; i += 2) {
    if (strcmp(argv[i], "--ops") == 0) snprintf(ops_arg, sizeof ops_arg, "%s", argv[i + 1]);
    else if (strcmp(argv[i], "--min") == 0) lo = parse_size(argv[i + 1]);
    else if (strcmp(argv[i], "--max") == 0) hi = parse_size(argv[i + 1]);
    else if (strcmp(argv[i], "--step") == 0) step = atoi(argv[i + 1]);
    else if (strcmp(argv[i], "--warmup") == 0) warmup = atoi(argv[i + 1]);
    else if (strcmp(argv[i], "--reps") == 0) reps = atoi(argv[i + 1]);
    else if (strcmp(argv[i], "--seconds") == 0) seconds = atof(argv[i + 1]);
    else {
      fprintf(stderr, "mpi_allreduce: unknown option %s\n", argv[i]);
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
  }
  int me, n;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  float* in = malloc(hi);
  float* out = malloc(hi);
  double* times = malloc(sizeof(double) * (size_t)reps);
  if (!in || !out || !times) {
    fprintf(stderr, "mpi_allreduce: out of memory for %zu bytes\n", hi);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  if (me == 0) printf("op,bytes,time_us,algbw_GBs,busbw_GBs\n");
  char* save = NULL;
  for (char* op = strtok_r(ops_arg, ",", &save); op; op = strtok_r(NULL, ",", &save)) {
    for (size_t bytes = lo; bytes <= hi; bytes *= (size_t)step) {
      const size_t per = bytes / 4 / (size_t)n, elems = bytes / 4;
      if (per == 0) continue;
      /* Check once: every rank holds me+1. */
      for (size_t i = 0; i < elems; ++i) in[i] = (float)(me + 1);
      if (run_op(op, in, out, bytes, n) != MPI_SUCCESS) MPI_Abort(MPI_COMM_WORLD, 3);
      double want = 1, got;
      if (strcmp(op, "allreduce") == 0) want = n * (n + 1) / 2.0, got = in[elems - 1];
      else if (strcmp(op, "reduce_scatter") == 0) want = n * (n + 1) / 2.0, got = out[per - 1];
      else if (strcmp(op, "broadcast") == 0) got = in[elems - 1];
      else want = n, got = out[(size_t)(n - 1) * per];
      if (got != want) {
        fprintf(stderr, "mpi_allreduce: %s of %zu bytes gave %g on rank %d, expected %g\n", op,
                bytes, got, me, want);
        MPI_Abort(MPI_COMM_WORLD, 4);
      }
      memset(in, 0, hi);
      for (int i = 0; i < warmup; ++i) run_op(op, in, out, bytes, n);
      MPI_Barrier(MPI_COMM_WORLD);
      double t0 = MPI_Wtime();
      run_op(op, in, out, bytes, n);
      double one = MPI_Wtime() - t0;
      MPI_Bcast(&one, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
      double it = seconds / reps / (one > 1e-7 ? one : 1e-7);
      int iters = it < 1 ? 1 : it > 20000 ? 20000 : (int)it;
      for (int r = 0; r < reps; ++r) {
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = MPI_Wtime();
        for (int i = 0; i < iters; ++i) run_op(op, in, out, bytes, n);
        double us = (MPI_Wtime() - t0) * 1e6 / iters;
        MPI_Allreduce(MPI_IN_PLACE, &us, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        times[r] = us;
      }
      qsort(times, (size_t)reps, sizeof(double), cmp_double);
      if (me == 0) {
        double t = times[0], alg = (double)bytes / (t * 1e-6) / 1e9;
        printf("%s,%zu,%.3f,%.4f,%.4f\n", op, bytes, t, alg, alg * bus_factor(op, n));
        fflush(stdout);
      }
    }
  }
  free(in);
  free(out);
  free(times);
  MPI_Finalize();
  return 0;
}
