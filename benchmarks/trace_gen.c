#include "trace_gen.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void trace_gen_defaults(trace_gen_params *p)
{
    *p = (trace_gen_params){
        .agents = 8,
        .turns = 60,
        .system_blocks = 8,
        .topics = 24,
        .doc_blocks_min = 16,
        .doc_blocks_max = 48,
        .new_blocks_per_turn = 2,
        .max_history_blocks = 32,
        .p_switch_topic = 0.15,
        .p_leave_session = 0.1,
        .p_resume = 0.5,
        .adversarial = 0,
        .adversary_topics = 400,
        .hint_turns = 0,
        .queue_len = 0,
        .agent_choice = TRACE_AGENTS_ROUNDS,
        .zipf_s = 1.0,
        .burst_mean = 4.0,
        .seed = 1,
    };
}

/* splitmix64: self-contained, so traces depend on the seed only. */
static uint64_t next_u64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static uint32_t below(uint64_t *s, uint32_t n) { return n ? (uint32_t)(next_u64(s) % n) : 0; }
static double unit(uint64_t *s) { return (double)(next_u64(s) >> 11) * (1.0 / 9007199254740992.0); }

/* Cumulative Zipf weights of ranks 1..n (exponent s), for zipf_draw. */
static double *zipf_cdf(uint32_t n, double s)
{
    double *cdf = malloc((n ? n : 1) * sizeof(*cdf));
    if (!cdf)
        return NULL;
    double sum = 0;
    for (uint32_t i = 0; i < n; i++)
        cdf[i] = sum += pow((double)(i + 1), -s);
    return cdf;
}

/* An index 0..n-1, index i with weight 1 / (i + 1)^s. */
static uint32_t zipf_draw(uint64_t *rng, const double *cdf, uint32_t n)
{
    if (n == 0)
        return 0;
    double x = unit(rng) * cdf[n - 1];
    uint32_t lo = 0, hi = n - 1;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (cdf[mid] < x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Sequence ids: 0 the system prompt, 1..topics the shared documents, then
 * the adversary's documents, then sessions as they are created. */
#define SYSTEM_SEQ 0u

typedef struct session {
    uint32_t seq;
    uint32_t blocks;
} session;

typedef struct agent_state {
    uint32_t topic_seq;
    session current;
    session *parked;
    uint32_t n_parked, cap_parked;
} agent_state;

static int read_seq(trace *t, uint32_t seq, uint32_t n, uint32_t agent, float tol)
{
    for (uint32_t i = 0; i < n; i++)
        if (trace_add(t, seq, i, agent, tol) != 0)
            return -1;
    return 0;
}

/* Document tolerances are drawn once per block; the access that first
 * names a block fixes it (trace_add keeps the first value). */
static float doc_tolerance(uint32_t seq, uint32_t index)
{
    uint64_t s = ((uint64_t)seq << 32) ^ index ^ 0x5bd1e995u;
    return (float)(0.3 + 0.6 * unit(&s));
}

static int read_doc(trace *t, uint32_t seq, uint32_t n, uint32_t agent)
{
    for (uint32_t i = 0; i < n; i++)
        if (trace_add(t, seq, i, agent, doc_tolerance(seq, i)) != 0)
            return -1;
    return 0;
}

static int park(agent_state *a)
{
    if (a->n_parked == a->cap_parked) {
        uint32_t cap = a->cap_parked ? a->cap_parked * 2 : 8;
        session *p = realloc(a->parked, cap * sizeof(*p));
        if (!p)
            return -1;
        a->parked = p;
        a->cap_parked = cap;
    }
    a->parked[a->n_parked++] = a->current;
    return 0;
}

/* One agent's turn, decided before any access is written, so that hints
 * can name what later turns will read. */
typedef struct planned_turn {
    uint32_t agent;
    uint32_t topic_seq;
    uint32_t session_seq;
    uint32_t history_blocks; /* read, including the ones this turn appends */
} planned_turn;

/* Priorities of hints: a sooner turn ranks higher. */
static int32_t turn_priority(size_t turn) { return (int32_t)(INT32_MAX - (int64_t)(turn % INT32_MAX)); }

static int hint_turn(trace *t, const trace_gen_params *p, const uint32_t *doc_len, const planned_turn *pt, size_t turn)
{
    int32_t prio = turn_priority(turn);
    if (trace_add_hint(t, SYSTEM_SEQ, 0, p->system_blocks, prio) != 0 ||
        trace_add_hint(t, pt->topic_seq, 0, doc_len[pt->topic_seq], prio) != 0 ||
        trace_add_hint(t, pt->session_seq, 0, pt->history_blocks, prio) != 0)
        return -1;
    return 0;
}

/* Before turn j of a causal queue: the first queue_len turns from j on
 * whose agent's previous turn has finished (prev[k] < j; none: UINT64_MAX
 * never, so a first turn is always queued). */
static int hint_causal_queue(trace *t, const trace_gen_params *p, const uint32_t *doc_len, const planned_turn *plan,
                             const size_t *prev, size_t n_turns, size_t j)
{
    uint32_t queued = 0;
    for (size_t k = j; k < n_turns && queued < p->queue_len; k++) {
        if (prev[k] != SIZE_MAX && prev[k] >= j)
            continue; /* its agent's previous turn has not run yet */
        if (hint_turn(t, p, doc_len, &plan[k], k) != 0)
            return -1;
        queued++;
    }
    return 0;
}

/* The agent of planned turn `turn` outside rounds. */
static uint32_t draw_agent(uint64_t *rng, const trace_gen_params *p, const double *agent_cdf, uint32_t adversary,
                           size_t turn, uint32_t last)
{
    if (adversary != UINT32_MAX && turn % (p->agents + 1) == p->agents)
        return adversary;
    if (p->agent_choice == TRACE_AGENTS_BURSTS && last < p->agents && p->burst_mean > 1 &&
        unit(rng) < 1.0 - 1.0 / p->burst_mean)
        return last;
    return zipf_draw(rng, agent_cdf, p->agents);
}

int trace_generate(trace *t, const trace_gen_params *p)
{
    uint64_t rng = p->seed * 0x2545f4914f6cdd1dull + 7;
    uint32_t n_agents = p->agents + (p->adversarial ? 1 : 0);
    uint32_t adversary = p->adversarial ? p->agents : UINT32_MAX;
    uint32_t span = p->doc_blocks_max > p->doc_blocks_min ? p->doc_blocks_max - p->doc_blocks_min + 1 : 1;
    uint32_t n_docs = 1 + p->topics + (p->adversarial ? p->adversary_topics : 0);
    size_t n_turns = (size_t)p->turns * n_agents;
    uint32_t *doc_len = malloc(n_docs * sizeof(*doc_len));
    agent_state *agents = calloc(n_agents, sizeof(*agents));
    uint32_t *order = malloc(n_agents * sizeof(*order));
    planned_turn *plan = malloc((n_turns ? n_turns : 1) * sizeof(*plan));
    size_t *prev = malloc((n_turns ? n_turns : 1) * sizeof(*prev));
    size_t *last_turn = malloc(n_agents * sizeof(*last_turn));
    double *agent_cdf = zipf_cdf(p->agents, p->zipf_s), *topic_cdf = zipf_cdf(p->topics, p->zipf_s);
    int rounds = p->agent_choice == TRACE_AGENTS_ROUNDS;
    int rc = -1;
    if (!doc_len || !agents || !order || !plan || !prev || !last_turn || !agent_cdf || !topic_cdf)
        goto out;
    for (uint32_t a = 0; a < n_agents; a++)
        last_turn[a] = SIZE_MAX;
    for (uint32_t d = 1; d < n_docs; d++)
        doc_len[d] = p->doc_blocks_min + below(&rng, span);
    uint32_t next_seq = n_docs;
    for (uint32_t a = 0; a < n_agents; a++) {
        agents[a].topic_seq = 1 + below(&rng, p->topics ? p->topics : 1);
        agents[a].current = (session){.seq = next_seq++, .blocks = 0};
    }
    /* The schedule: turns in rounds, each round in a shuffled order, or
     * one agent at a time drawn by Zipf (with bursts). */
    size_t planned = 0;
    uint32_t last_agent = UINT32_MAX;
    for (uint32_t turn = 0; turn < p->turns; turn++) {
        for (uint32_t i = 0; i < n_agents; i++)
            order[i] = i;
        for (uint32_t i = n_agents; rounds && i > 1; i--) {
            uint32_t j = below(&rng, i), tmp = order[i - 1];
            order[i - 1] = order[j];
            order[j] = tmp;
        }
        for (uint32_t k = 0; k < n_agents; k++) {
            uint32_t a = rounds ? order[k] : draw_agent(&rng, p, agent_cdf, adversary, planned, last_agent);
            last_agent = a;
            agent_state *st = &agents[a];
            if (a == adversary) {
                /* A topic from its own pool each turn; no session reuse. */
                st->topic_seq = 1 + p->topics + below(&rng, p->adversary_topics);
                st->current = (session){.seq = next_seq++, .blocks = 0};
            } else {
                if (p->topics && unit(&rng) < p->p_switch_topic)
                    st->topic_seq = 1 + (rounds ? below(&rng, p->topics) : zipf_draw(&rng, topic_cdf, p->topics));
                if (unit(&rng) < p->p_leave_session || st->current.blocks >= p->max_history_blocks) {
                    if (park(st) != 0)
                        goto out;
                    if (st->n_parked > 1 && unit(&rng) < p->p_resume) {
                        /* Returning session: take a parked one (not the one
                         * just left) back. */
                        uint32_t j = below(&rng, st->n_parked - 1);
                        st->current = st->parked[j];
                        st->parked[j] = st->parked[--st->n_parked];
                    } else {
                        st->current = (session){.seq = next_seq++, .blocks = 0};
                    }
                }
            }
            uint32_t grow = 1 + below(&rng, p->new_blocks_per_turn ? p->new_blocks_per_turn : 1);
            st->current.blocks += grow;
            prev[planned] = last_turn[a];
            last_turn[a] = planned;
            plan[planned++] = (planned_turn){.agent = a,
                                             .topic_seq = st->topic_seq,
                                             .session_seq = st->current.seq,
                                             .history_blocks = st->current.blocks};
        }
    }
    /* The accesses: a turn reads its whole context in order. */
    for (size_t j = 0; j < n_turns; j++) {
        /* The scheduler's queue, soonest first, renewed at every turn:
         * causal, or the oracle's next hint_turns planned turns. */
        if (p->queue_len) {
            if (hint_causal_queue(t, p, doc_len, plan, prev, n_turns, j) != 0)
                goto out;
        } else {
            for (size_t k = j; p->hint_turns && k < j + p->hint_turns && k < n_turns; k++)
                if (hint_turn(t, p, doc_len, &plan[k], k) != 0)
                    goto out;
        }
        const planned_turn *pt = &plan[j];
        if (read_seq(t, SYSTEM_SEQ, p->system_blocks, pt->agent, 0.1f) != 0 ||
            read_doc(t, pt->topic_seq, doc_len[pt->topic_seq], pt->agent) != 0 ||
            read_seq(t, pt->session_seq, pt->history_blocks, pt->agent, 0.6f) != 0)
            goto out;
    }
    rc = 0;
out:
    if (agents)
        for (uint32_t a = 0; a < n_agents; a++)
            free(agents[a].parked);
    free(agents);
    free(doc_len);
    free(order);
    free(plan);
    free(prev);
    free(last_turn);
    free(agent_cdf);
    free(topic_cdf);
    return rc;
}
